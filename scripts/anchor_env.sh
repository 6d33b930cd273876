# Sourced by the device scripts: installs FlashMLA from a wheel in .anchors/ (an ignored folder carried with
# the checkout), if there is one, so that the decode benchmarks add their FlashMLA BF16 rows.
shopt -s nullglob
_wheels=(.anchors/flash_mla-*.whl)
if [ ${#_wheels[@]} -gt 0 ]; then
  python3 -m pip install -q --no-deps --target .anchors/site "${_wheels[0]}" 2>&1 | tail -2
  export PYTHONPATH="$PWD/.anchors/site:$PYTHONPATH"
fi
shopt -u nullglob
python3 -c "import flash_mla, torch; print('flash_mla', getattr(flash_mla, '__version__', '?'), 'torch', torch.__version__)" \
  2>&1 | tail -1
