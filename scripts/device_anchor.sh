#!/usr/bin/env bash
# Every decode speed claim as a ratio against FlashMLA BF16, in one device call (< 8 minutes on an H200):
#   1. installs FlashMLA from a wheel in .anchors/ (an ignored folder carried with the checkout), if there is one;
#   2. the decode benchmark at the 8 headline shapes: our BF16 and FP8 kernels and FlashMLA on the same values,
#      each row with its ratio to FlashMLA (vs_flashmla, with its interval), GB/s, TFLOP/s and the fraction of
#      the read bandwidth measured in the same run (torch.sum over 4 GiB);
#   3. the end-to-end decode step (8 layers at DeepSeek-V2-Lite attention dims, CUDA graphs): snapmla on the
#      Triton kernels vs the bf16 preset on FlashMLA, at batch 32 / 32K and at a 16 GiB KV-cache budget (each
#      at the largest batch that fits).
#   SNAPQUANT_GIT_COMMIT=<hash of HEAD, written out where the tree is committed> bash scripts/device_anchor.sh
# (a copied checkout can carry git metadata older than its files, so `git rev-parse` there may name the wrong commit)
# BENCH_BUDGET_S (170), BENCH_TIMEOUT_S (270) and E2E_TIMEOUT_S (180) shrink the two steps when this script runs
# after another one in the same device call (scripts/device_profile.sh with ANCHOR=1 sets them).
# Without a wheel (or FlashMLA installed otherwise) the benchmarks run and their FlashMLA rows say
# "FlashMLA not installed". Results: results/bench/{decode,bench}_anchor_h200.*, results/bench/e2e_anchor_h200.*;
# logs in $OUT, everything in $OUT/device_anchor.tar.gz.
set -o pipefail
source scripts/commit_env.sh  # the commit the results record (stops here without one)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/device_anchor}"
RES=results/bench
mkdir -p "$OUT" "$RES"
trap 'tar -czf "$OUT/device_anchor.tar.gz" $RES/*anchor_h200* "$OUT"/*.log "$OUT"/*.txt 2>/dev/null' EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
source scripts/anchor_env.sh > "$OUT/flashmla.txt"; cat "$OUT/flashmla.txt"
timeout "${BENCH_TIMEOUT_S:-270}" python3 scripts/bench_decode.py --out "$RES" --tag anchor_h200 --no-append \
  --budget-s "${BENCH_BUDGET_S:-170}" \
  --shapes 128x16x4096,32x16x16384,8x16x32768,32x64x8192,4x64x8192,128x128x4096,64x128x8192,1x128x32768 \
  --variants "bf16,snapmla,snapmla+gluon+fp8mma" 2>&1 | tee "$OUT/bench_anchor.log" \
  | grep -E "read bandwidth| us |SKIPPED|Targets" | head -48
timeout "${E2E_TIMEOUT_S:-180}" python3 scripts/bench_e2e.py --device cuda --layers 8 --batch 32 --contexts 32768 --steps 5 \
  --presets bf16@flashmla,snapmla --backend triton --graphs --no-stock --kv-budget-gib 16 \
  --out "$RES/e2e_anchor_h200.json" 2>&1 | tee "$OUT/e2e_anchor.log" | grep -E "^(batch|kv_budget|Traceback|error)|Error" | head -20
