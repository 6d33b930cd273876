#!/usr/bin/env bash
# lm-eval generation on the GPU in bounded device calls (each < 8 minutes on an H200): the GPU tests of the
# decode loop and the graph step, then HF generate vs the decode loop (scripts/bench_eval.py) on one part
# of the grid; every part merges into results/bench/eval_h200.{csv,md,json}.
#   bash scripts/device_eval.sh 1      # GPU tests + V2-Lite shape, snapmla
#   bash scripts/device_eval.sh 2      # V2-Lite shape, bf16
#   bash scripts/device_eval.sh 3      # V3 shape (as many layers as fit), both presets, batch 32
#   bash scripts/device_eval.sh 4      # < 560 s: lm-eval from .whl/ if present, GPU tests of the loop, then V2-Lite
#                                      # shape, bf16 + snapmla: SnapquantLM.generate_until end to end (1K prompts,
#                                      # 256 new tokens, batch 32 / 128) and decode-loop rows at 1K / 8K / 32K, batch 32
#   bash scripts/device_eval.sh 5      # < 560 s: lm-eval from .whl/, then slot refill on/off end to end (V2-Lite,
#                                      # snapmla, batch 32, scattered stops), HF generate bf16 at batch 32 (the stock
#                                      # path's row beside the loop's), and the V3 shape (as many layers as fit), both
#                                      # presets, decode-loop rows at batch 32 / 128 and 1K / 8K / 32K
#   bash scripts/device_eval.sh 6      # < 560 s: where the time goes: V2-Lite, bf16 + snapmla, decode-loop rows at
#                                      # batch 32 / 128 and 1K / 32K with --kernels (profiler tables of the captured
#                                      # step and of one 1K prefill) and per-step samples (ratio intervals), then the
#                                      # V3 shape's snapmla batch-128 32K cell again (the cache fill is chunked now)
#   bash scripts/device_eval.sh 7      # < 400 s: GPU tests of the experts, norms, rotary, projections, loop and graphs, then V2-Lite bf16 + snapmla
#                                      # end to end (1K prompts, 256 new tokens, batch 128 / 32) and the 32K batch-32
#                                      # decode-loop rows; into results/bench/eval_h200 on an H200, results/h100/eval_e2e_h100 otherwise
#   CASE_S=470 bash scripts/device_eval.sh 6  # a case's later parts stop earlier (default 530 s)
#   SMOKE=1 bash scripts/device_eval.sh 4   # the same steps on CPU (tiny model, no install), into $OUT only
# Logs go to $OUT (default /tmp/device_eval) and the results folder; case 4 also packs them into
# $OUT/device_eval4.tgz.
set -o pipefail
source scripts/commit_env.sh  # the commit the results record (stops here without one)
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
  4) source scripts/wheels_env.sh
     timeout 60 python -c "import lm_eval, lm_eval.evaluator, lm_eval.models.huggingface, datasets, fsspec, pyarrow, \
huggingface_hub, transformers, torch; import snapquant.eval.lm; print('imports ok: lm_eval', lm_eval.__version__, \
'datasets', datasets.__version__, 'fsspec', fsspec.__version__, 'pyarrow', pyarrow.__version__, 'hub', \
huggingface_hub.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)" 2>&1 \
       | tee "$OUT/imports.txt" | tail -3
     timeout 100 python -m pytest -m gpu -rfEs -q -p no:cacheprovider tests/test_generation.py tests/test_graphs.py tests/test_refill.py \
       2>&1 | tee "$OUT/pytest_gpu_eval4.txt" | tail -4
     # smoke: the tiny model's own small grid (its defaults), results only in $OUT
     grid=(--models v2lite --out results/bench/eval_h200 --e2e-batches 32,128 --e2e-prompt 1024 --e2e-new-tokens 256
           --batches 32 --contexts 1024,8192,32768 --new-tokens 64 --check-tokens 16)
     [ -n "$SMOKE" ] && grid=(--smoke --out "$OUT/eval_smoke")
     left=$((${CASE_S:-530} - SECONDS))  # the whole case ends before 560 s: the last cell may overrun its estimate
     timeout $((left > 60 ? left - 10 : 50)) python scripts/bench_eval.py "${grid[@]}" --presets bf16,snapmla \
       --e2e-lmeval --e2e-n-batches 2 --paths loop --budget-s $((left > 120 ? left - 60 : 60)) \
       2>&1 | tee "$OUT/eval_part4.log" | grep -v "^USDT" | tail -30
     [ -z "$SMOKE" ] && cp results/bench/eval_h200.* "$OUT"/
     tar czf "$OUT/device_eval4.tgz" -C "$OUT" --exclude device_eval4.tgz . 2>/dev/null
     echo "case 4 done in ${SECONDS}s" ;;
  5) source scripts/wheels_env.sh
     smoke=(); [ -n "$SMOKE" ] && smoke=(--smoke)
     dest=results/bench/eval_h200; [ -n "$SMOKE" ] && dest="$OUT/eval_smoke5"
     timeout 150 python scripts/bench_eval.py "${smoke[@]}" --out "$dest" --models v2lite --presets snapmla \
       --e2e-lmeval --e2e-batches 32 --e2e-prompt 1024 --e2e-new-tokens 256 --e2e-n-batches 3 --refill 100 --paths "" \
       --budget-s 120 2>&1 | tee "$OUT/eval_part5a.log" | grep -v "^USDT" | tail -8
     timeout 110 python scripts/bench_eval.py "${smoke[@]}" --out "$dest" --models v2lite --presets bf16 --paths hf \
       --batches 32 --contexts 1024 --new-tokens 32 --check-tokens 0 --no-split --budget-s 90 \
       2>&1 | tee "$OUT/eval_part5b.log" | grep -v "^USDT" | tail -4
     left=$((${CASE_S:-530} - SECONDS))
     timeout $((left > 60 ? left - 10 : 50)) python scripts/bench_eval.py "${smoke[@]}" --out "$dest" --models v3 \
       --presets bf16,snapmla --paths loop --batches 32,128 --contexts 1024,8192,32768 --new-tokens 64 --check-tokens 16 \
       --budget-s $((left > 120 ? left - 60 : 60)) 2>&1 | tee "$OUT/eval_part5c.log" | grep -v "^USDT" | tail -20
     [ -z "$SMOKE" ] && cp results/bench/eval_h200.* "$OUT"/
     tar czf "$OUT/device_eval5.tgz" -C "$OUT" --exclude device_eval5.tgz . 2>/dev/null
     echo "case 5 done in ${SECONDS}s" ;;
  6) smoke=(); [ -n "$SMOKE" ] && smoke=(--smoke)
     dest=results/bench/eval_h200; [ -n "$SMOKE" ] && dest="$OUT/eval_smoke6"
     timeout 400 python scripts/bench_eval.py "${smoke[@]}" --out "$dest" --models v2lite --presets bf16,snapmla \
       --paths loop --batches 32,128 --contexts 1024,32768 --new-tokens 64 --check-tokens 0 --no-split --kernels \
       --budget-s 340 2>&1 | tee "$OUT/eval_part6a.log" | grep -v "^USDT" | tail -12
     left=$((${CASE_S:-530} - SECONDS))
     [ "$left" -gt 90 ] && timeout $((left - 10)) python scripts/bench_eval.py "${smoke[@]}" --out "$dest" --models v3 \
       --presets bf16,snapmla --paths loop --batches 128 --contexts 32768 --new-tokens 64 --check-tokens 0 \
       --no-split --budget-s $((left - 40)) 2>&1 | tee "$OUT/eval_part6b.log" | grep -v "^USDT" | tail -6
     [ -z "$SMOKE" ] && cp results/bench/eval_h200.* "$OUT"/
     tar czf "$OUT/device_eval6.tgz" -C "$OUT" --exclude device_eval6.tgz . 2>/dev/null
     echo "case 6 done in ${SECONDS}s" ;;
  7) source scripts/wheels_env.sh
     # rows go to the file of the GPU they ran on (an H100 lease must not merge into the H200 table)
     dest=results/bench/eval_h200
     nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H200 || dest=results/h100/eval_e2e_h100
     smoke=(); [ -n "$SMOKE" ] && { smoke=(--smoke); dest="$OUT/eval_smoke7"; }
     timeout 150 python -m pytest -m gpu -rfEs -q -p no:cacheprovider tests/test_experts.py tests/test_expert_kernels.py tests/test_rms_norm.py tests/test_generation.py \
       tests/test_graphs.py tests/test_absorb_kernels.py tests/test_rotary.py 2>&1 | tee "$OUT/pytest_gpu_eval7.txt" | tail -4
     timeout 220 python scripts/bench_eval.py "${smoke[@]}" --out "$dest" --models v2lite --presets bf16,snapmla \
       --e2e-lmeval --e2e-batches 128,32 --e2e-prompt 1024 --e2e-new-tokens 256 --e2e-n-batches 3 --paths "" \
       --budget-s 200 2>&1 | tee "$OUT/eval_part7a.log" | grep -v "^USDT" | tail -8
     left=$((${CASE_S:-530} - SECONDS))
     [ "$left" -gt 60 ] && timeout $((left - 10)) python scripts/bench_eval.py "${smoke[@]}" --out "$dest" \
       --models v2lite --presets bf16,snapmla --paths loop --batches 32 --contexts 32768 --new-tokens 64 \
       --check-tokens 0 --no-split --budget-s $((left - 30)) 2>&1 | tee "$OUT/eval_part7b.log" | grep -v "^USDT" | tail -6
     [ -z "$SMOKE" ] && cp "$dest".* "$OUT"/
     echo "case 7 done in ${SECONDS}s" ;;
esac
[ -z "$SMOKE" ] && cp results/bench/eval_h200.* "$OUT"/ 2>/dev/null
exit 0
