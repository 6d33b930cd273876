#!/usr/bin/env bash
# The kernels' GPU check in one device call (< 9 minutes on an H200): every kernel against the reference,
# the GPU test suite, the decode benchmark at the headline shapes (with FlashMLA BF16 rows when its wheel
# is in .anchors/, see scripts/anchor_env.sh), and the PTX of every default launch.
#   SNAPQUANT_GIT_COMMIT=<hash of HEAD, written out where the tree is committed> bash scripts/device_check.sh
# (a copied checkout can carry git metadata older than its files, so `git rev-parse` there may name the wrong commit)
# Logs go to $OUT; the full outputs (kernels_check.*, decode_h200.*, bench_h200.*, PTX) to $OUT/device_check.tar.gz.
set -o pipefail
source scripts/commit_env.sh  # the commit the results record (stops here without one)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/device_check}"
W=$(mktemp -d)
mkdir -p "$OUT"
trap 'tar -czf "$OUT/device_check.tar.gz" -C "$W" . 2>/dev/null' EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
source scripts/anchor_env.sh > "$OUT/flashmla.txt"; cat "$OUT/flashmla.txt"
source scripts/wheels_env.sh  # lm-eval for the generation tests (they skip without it)
timeout 200 python scripts/check_kernels_gpu.py --no-bench --out "$W/kernels" 2>&1 | tee "$OUT/check_h200.log" | tail -4
timeout 200 python -m pytest -m gpu -rfEs -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu_h200.txt" | tail -6
timeout 120 python scripts/bench_decode.py --out "$W/bench" --no-append --budget-s 80 \
  --shapes 128x16x4096,32x16x16384,8x16x32768,32x64x8192,4x64x8192,128x128x4096,64x128x8192,1x128x32768 \
  --variants "bf16,snapmla,snapmla+gluon+fp8mma" 2>&1 | tee "$OUT/bench_h200.log" | grep -E " us |Targets" | head -40
timeout 60 python scripts/dump_ptx.py --out "$W/ptx" > "$W/dump_ptx.log" 2>&1
