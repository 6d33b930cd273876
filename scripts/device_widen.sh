#!/usr/bin/env bash
# gluon.narrow's e4m3 -> fp16 widening by integer operations against cvt (the conversion unit), in one device
# call (carry .anchors for the FlashMLA rows):
#   1. the GPU tests of the Gluon kernels: every widen mode gives the cvt kernel's bits, every kernel the
#      reference's numbers;
#   2. the decode benchmark at the three H = 16 headline shapes and at 32x16x32768 (one V2-Lite layer of the 32K, batch-32 decode step): our BF16, the FP8 default and the five widen
#      modes (each checked against the FP8 default with tolerance 0: the same bits), FlashMLA beside them.
#   SNAPQUANT_GIT_COMMIT=<hash of HEAD, written out> bash scripts/device_widen.sh
# TAG (widen), VARIANTS, SHAPES, TESTS (a -k filter) and TEST_FILES (default tests/test_kernels_gluon.py) narrow a
# call; TEST_S=0 skips the tests. Results: results/bench/decode_<TAG>_h200.* on an H200, results/h100/decode_<TAG>_h100.* elsewhere (a
# non-H200 machine's rows never go into the H200 tables); logs in $OUT.
set -o pipefail
source scripts/commit_env.sh  # the commit the results record (stops here without one)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/device_widen}"
mkdir -p "$OUT"
tag=${TAG:-widen}_h200; RES=results/bench
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H200 || { tag=${TAG:-widen}_h100; RES=results/h100; }
mkdir -p "$RES"
source scripts/anchor_env.sh > "$OUT/flashmla.txt" 2>&1; cat "$OUT/flashmla.txt"
[ "${TEST_S:-150}" -gt 0 ] && timeout "${TEST_S:-150}" python3 -m pytest -m gpu -rfEs -q -p no:cacheprovider ${TEST_FILES:-tests/test_kernels_gluon.py} \
  -k "${TESTS:-integer or narrow or matches_the_reference}" 2>&1 | tee "$OUT/pytest_widen.txt" | tail -3
timeout "${BENCH_S:-300}" python3 scripts/bench_decode.py --out "$RES" --tag "$tag" --no-append \
  --budget-s "$(( ${BENCH_S:-300} - 40 ))" --shapes "${SHAPES:-128x16x4096,32x16x16384,8x16x32768,32x16x32768}" \
  --variants "${VARIANTS:-bf16,snapmla,snapmla+int,snapmla+int_qk,snapmla+int_pv,snapmla+int_pv2,snapmla+int_qk_pv2}" 2>&1 \
  | tee "$OUT/bench_widen.log" | grep -E "read bandwidth| us |SKIPPED|FAIL|Error" | head -40
cp "$RES"/*"$tag"* "$OUT"/ 2>/dev/null
exit 0
