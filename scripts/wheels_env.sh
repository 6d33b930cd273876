# Sourced by the device scripts: lm-eval and datasets are not in the device image, so install the wheels
# carried in .whl/ (an ignored folder travelling with the checkout), if there are any, into /tmp/site.
# PYTHONPATH comes before site-packages: .whl/ holds only what the image lacks, so nothing is shadowed.
if [ -z "$SMOKE" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>&1 | tail -3
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site"
fi
