#!/usr/bin/env bash
# lm-eval generation on the GPU in bounded device calls (each < 8 minutes on an H200): the GPU tests of the
# decode loop and the graph step, then HF generate vs the decode loop (scripts/bench_eval.py) on one part
# of the grid; every part merges into results/bench/eval_h200.{csv,md,json}.
#   bash scripts/device_eval.sh 1      # GPU tests + V2-Lite shape, snapmla
#   bash scripts/device_eval.sh 2      # V2-Lite shape, bf16
#   bash scripts/device_eval.sh 3      # V3 shape (as many layers as fit), both presets, batch 32
# Logs go to $OUT (default /tmp/device_eval) and the results folder.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/device_eval}"
mkdir -p "$OUT" results/bench
cp results/bench/eval_h200.* "$OUT"/ 2>/dev/null
case "${1:-1}" in
  1) timeout 120 python -m pytest -m gpu -rfEs -q -p no:cacheprovider tests/test_generation.py tests/test_graphs.py \
       2>&1 | tee "$OUT/pytest_gpu_eval.txt" | tail -4
     timeout 330 python scripts/bench_eval.py --models v2lite --presets snapmla --budget-s 270 \
       2>&1 | tee "$OUT/eval_part1.log" | grep -v "^USDT" | tail -30 ;;
  2) timeout 450 python scripts/bench_eval.py --models v2lite --presets bf16 --budget-s 390 \
       2>&1 | tee "$OUT/eval_part2.log" | grep -v "^USDT" | tail -30 ;;
  3) timeout 450 python scripts/bench_eval.py --models v3 --batches 32 --contexts 1024,8192 --budget-s 360 \
       2>&1 | tee "$OUT/eval_part3.log" | grep -v "^USDT" | tail -30 ;;
esac
cp results/bench/eval_h200.* "$OUT"/ 2>/dev/null
exit 0
