#!/usr/bin/env bash
# One device call for the end of a working session, picked by the GPU it lands on (carry .whl and .anchors):
#   H200: the lm-eval end-to-end targets (`device_eval.sh 7`) and the H = 16 decode rows beside FlashMLA
#         (`device_widen.sh` with TAG=anchor16: our BF16 (Triton rows, and gluon.narrow_bf16 with two slots
#         and with one) and the FP8 default);
#   other GPUs: `pytest -m gpu` (the whole GPU suite), into results/h100/pytest_gpu_h100.txt, then the same
#         H = 16 decode rows beside FlashMLA into results/h100/.
#   SNAPQUANT_GIT_COMMIT=<hash of HEAD, written out> bash scripts/device_session.sh
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/device_session}"
DECODE_VARIANTS=bf16,bf16+gluon,bf16+gluon+s1,snapmla
mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "gpu: $gpu"
if echo "$gpu" | grep -q H200; then
  OUT="$OUT/eval" bash scripts/device_eval.sh 7 2>&1 | tail -12
  OUT="$OUT/decode" TAG=anchor16 VARIANTS=$DECODE_VARIANTS TESTS=narrow TEST_S=90 BENCH_S=200 bash scripts/device_widen.sh 2>&1 | tail -12
else
  mkdir -p results/h100
  source scripts/wheels_env.sh > "$OUT/wheels.txt" 2>&1  # lm-eval for the generation and refill tests
  { echo "# python -m pytest -m gpu -rfEs -q at commit ${SNAPQUANT_GIT_COMMIT:-?} on $gpu"
    timeout 330 python -m pytest -m gpu -rfEs -q -p no:cacheprovider 2>&1 | grep -v "^USDT"
    echo "exit status: $?"; } \
    | tee results/h100/pytest_gpu_h100.txt | tail -8
  cp results/h100/pytest_gpu_h100.txt "$OUT"/
  OUT="$OUT/decode" TAG=anchor16 VARIANTS=$DECODE_VARIANTS TEST_S=0 BENCH_S=200 bash scripts/device_widen.sh 2>&1 | tail -12
fi
