#!/usr/bin/env bash
# A working session's device calls, one part per call (each under 10 minutes; carry .whl and .anchors):
#   decode (default)  the GPU tests of gluon.narrow_bf16, then our kernels beside FlashMLA: at H = 16 our BF16
#                     (gluon.narrow_bf16 with two slots and with one, the Triton rows tile) and the FP8 default
#                     (TAG=anchor16); past 16 rows our BF16 (gluon.wide) at the H = 64 / 128 shapes
#                     (TAG=anchor64); ~100 s of kernels plus compilation
#   eval              the lm-eval end-to-end targets (`device_eval.sh 7`, ~530 s)
#   tests             `pytest -m gpu` (the whole GPU suite) into results/<h200|h100>/pytest_gpu_*.txt, ~330 s
# Rows land in results/bench/ on an H200 and in results/h100/ on any other GPU (never in the H200 tables).
#   SNAPQUANT_GIT_COMMIT=<hash of HEAD, written out> bash scripts/device_session.sh [decode|eval|tests]
set -o pipefail
source scripts/commit_env.sh  # the commit the results record (stops here without one)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/device_session}"
PART="${1:-decode}"
mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "gpu: $gpu, part: $PART"
case "$PART" in
  decode)
    OUT="$OUT/decode" TAG=anchor16 VARIANTS=bf16,bf16+gluon+s1,bf16+rows,snapmla TESTS="narrow_bf16" \
      TEST_S=100 BENCH_S=150 bash scripts/device_widen.sh 2>&1 | tail -12
    OUT="$OUT/decode64" TAG=anchor64 VARIANTS=bf16 \
      SHAPES=32x64x8192,4x64x8192,128x128x4096,64x128x8192,1x128x32768 TEST_S=0 BENCH_S=110 \
      bash scripts/device_widen.sh 2>&1 | tail -10 ;;
  eval)
    OUT="$OUT/eval" bash scripts/device_eval.sh 7 2>&1 | tail -12 ;;
  tests)
    dir=results/h100; name=pytest_gpu_h100.txt
    echo "$gpu" | grep -q H200 && { dir=results/gpu_check; name=pytest_gpu_h200.txt; }
    mkdir -p "$dir"
    source scripts/wheels_env.sh > "$OUT/wheels.txt" 2>&1  # lm-eval for the generation and refill tests
    { echo "# python -m pytest -m gpu -rfEs -q at commit ${SNAPQUANT_GIT_COMMIT:-?} on $gpu"
      timeout 500 python -m pytest -m gpu -rfEs -q -p no:cacheprovider 2>&1 | grep -v "^USDT"
      echo "exit status: $?"; } \
      | tee "$dir/$name" | tail -8
    cp "$dir/$name" "$OUT"/ ;;
  *)
    echo "unknown part '$PART': decode | eval | tests"; exit 2 ;;
esac
exit 0
