#!/usr/bin/env bash
# A working session's device calls, one part per call (each under 10 minutes; carry .whl and .anchors):
#   decode (default)  the side-by-side table of the decode issue: our BF16, the FP8 default and the native FP8
#                     kernel (opt-in) beside FlashMLA at the eight anchor shapes (TAG=sidebyside), ~250 s on an H200
#   eval              the lm-eval end-to-end targets (`device_eval.sh 7`, ~530 s)
#   tests             `scripts/check_kernels_gpu.py --no-bench` and `pytest -m gpu` (the whole GPU suite) into
#                     results/<gpu_check|h100>/check_*.log and pytest_gpu_*.txt, ~115 s + the check on an H200
#                     (CHECK_S and TESTS_S bound them, default 150 and 500)
#   all               tests (bounded to 250 s), then decode: both in one machine start
#   quick             the fused step kernels' GPU tests, the 32K batch-32 rows of both presets, the projections A/B
#                     at 1K (~320 s, any GPU)
#   step              the fused step kernels' GPU tests and A/B probes, the L2 prefetch's timings (~480 s, any GPU)
#   splits            the narrow kernels' split-count rule, A/B in the 32K batch-32 step of both presets (~90 s)
#   stream            the page-ring stream probe (scripts/probe_stream.py) beside FlashMLA, and its GPU test (carry
#                     .anchors)
#   followup          splits, then stream, then the GPU suite (TESTS_S, default 280): ~500 s, any GPU
#   slot1             the <= 16-row kernels with one slot, three programs per SM (exact, native QK, both native):
#                     their GPU tests, then two H = 16 shapes beside the two-slot kernels and FlashMLA (~250 s)
#   halves            gluon.narrow_halves (num_warps=8 at <= 16 rows): its reference tests, then three H = 16 shapes beside
#                     the default and FlashMLA (~200 s, any GPU)
#   profile16         ncu of the default H = 16 kernel, gluon.narrow_halves and FlashMLA at 128x16x4096 (~200 s)
#   qk8               the native e4m3 QK in gluon.narrow (fp8_mma="qk") and both products native at 16 rows (gluon.narrow8,
#                     fp8_mma=True): their GPU tests, then three
#                     H = 16 shapes (B x L = 128 x 4K, 32 x 16K, 32 x 32K) beside FlashMLA (~250 s, any GPU; TEST_S,
#                     BENCH_S and SHAPES shorten it)
# Rows land in results/bench/ on an H200 and in results/h100/ on any other GPU (never in the H200 tables).
#   SNAPQUANT_GIT_COMMIT=<hash of HEAD, written out> bash scripts/device_session.sh [decode|eval|tests|all]
set -o pipefail
source scripts/commit_env.sh  # the commit the results record (stops here without one)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/device_session}"
PART="${1:-decode}"
mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "gpu: $gpu, part: $PART"
run_tests() {
  local dir=results/h100 name=pytest_gpu_h100.txt
  echo "$gpu" | grep -q H200 && { dir=results/gpu_check; name=pytest_gpu_h200.txt; }
  name_check=${name/pytest_gpu/check}; name_check=${name_check%.txt}.log
  mkdir -p "$dir"
  source scripts/wheels_env.sh > "$OUT/wheels.txt" 2>&1  # lm-eval for the generation and refill tests
  # every kernel against the reference (no timings): its log beside the suite's
  { echo "# python scripts/check_kernels_gpu.py --no-bench at commit ${SNAPQUANT_GIT_COMMIT:-?} on $gpu"
    timeout "${CHECK_S:-150}" python scripts/check_kernels_gpu.py --no-bench --out "$OUT/kernels_check" 2>&1 \
      | grep -v "^USDT" | tail -40
    echo "exit status: $?"; } | tee "$dir/$name_check" | tail -4
  { echo "# python -m pytest -m gpu -rfEs -q at commit ${SNAPQUANT_GIT_COMMIT:-?} on $gpu"
    timeout "${TESTS_S:-500}" python -m pytest -m gpu -rfEs -q -p no:cacheprovider 2>&1 | grep -v "^USDT"
    echo "exit status: $?"; } \
    | tee "$dir/$name" | tail -8
  cp "$dir/$name" "$dir/$name_check" "$OUT"/
}
run_decode() {
  OUT="$OUT/decode" TAG=sidebyside VARIANTS=bf16,snapmla,snapmla+gluon+fp8mma TEST_S=0 BENCH_S="${BENCH_S:-300}" \
    SHAPES=128x16x4096,32x16x16384,8x16x32768,32x64x8192,4x64x8192,128x128x4096,64x128x8192,1x128x32768 \
    bash scripts/device_widen.sh 2>&1 | grep -v "FAIL" | tail -30
}
case "$PART" in
  decode) run_decode ;;
  eval)
    OUT="$OUT/eval" bash scripts/device_eval.sh 7 2>&1 | tail -12 ;;
  tests) run_tests ;;
  quick)  # ~320 s: the step kernels' GPU tests, the 32K batch-32 decode-loop rows of both presets (the ratio the
          # end-to-end issue asks for), the projections A/B at 1K batch 32
    source scripts/wheels_env.sh > "$OUT/wheels.txt" 2>&1
    dest=results/bench/eval_h200; echo "$gpu" | grep -q H200 || dest=results/h100/eval_e2e_h100
    timeout 110 python -m pytest -m gpu -rfEs -q -p no:cacheprovider tests/test_absorb_kernels.py tests/test_rotary.py \
      tests/test_kernels_gluon.py tests/test_graphs.py tests/test_generation.py -k "l2_prefetch or projections or \
      switch or graph or loop or generat" 2>&1 | grep -v "^USDT" | tee "$OUT/pytest_quick.txt" | tail -4
    timeout 150 python scripts/bench_eval.py --out "$dest" --models v2lite --presets bf16,snapmla --paths loop \
      --batches 32 --contexts 32768 --new-tokens 64 --check-tokens 0 --no-split --budget-s 140 2>&1 \
      | grep -v "^USDT" | tail -6
    cp "$dest".* "$OUT"/
    timeout 70 python scripts/probe_step_ab.py --switch projections --presets snapmla --batches 32 --contexts 1024 \
      --steps 40 --out "$OUT/ab_projections.json" 2>&1 | grep -v "^USDT" | tail -2 ;;
  step)  # this session's step changes on any GPU: their GPU tests, the projections A/B (1K, b32 / b128), the L2
         # prefetch's kernel timings at H = 16 beside FlashMLA, and its A/B in the 32K batch-32 step (~480 s)
    source scripts/wheels_env.sh > "$OUT/wheels.txt" 2>&1
    timeout 120 python -m pytest -m gpu -rfEs -q -p no:cacheprovider tests/test_absorb_kernels.py tests/test_rotary.py \
      tests/test_kernels_gluon.py tests/test_graphs.py -k "l2_prefetch or projections or switch or graph" 2>&1 \
      | grep -v "^USDT" | tee "$OUT/pytest_step.txt" | tail -4
    timeout 110 python scripts/probe_step_ab.py --switch projections --presets snapmla --batches 32,128 --contexts 1024 \
      --steps 40 --out "$OUT/ab_projections.json" 2>&1 | grep -v "^USDT" | tail -3
    OUT="$OUT/pf" TAG=pf TEST_S=0 BENCH_S=130 SHAPES=128x16x4096,32x16x16384,32x16x32768 \
      VARIANTS=bf16,snapmla,snapmla+pf1,snapmla+pf2,snapmla+pf4,bf16+pf2,snapmla+splits8+narrow bash scripts/device_widen.sh 2>&1 | tail -14
    timeout 110 python scripts/probe_step_ab.py --switch prefetch --prefetch 2 --presets snapmla --batches 32 \
      --contexts 32768 --steps 24 --out "$OUT/ab_prefetch.json" 2>&1 | grep -v "^USDT" | tail -2 ;;
  splits)  # the split-count rule's A/B in the 32K batch-32 step, both presets (~90 s on an H100)
    timeout 200 python scripts/probe_step_ab.py --switch splits --presets bf16,snapmla --batches 32 \
      --contexts 32768 --steps 24 --out "$OUT/ab_splits.json" 2>&1 | grep -v "^USDT" | tail -3 ;;
  stream)  # the page-ring stream probe (which ring streams 40 KB pages at the read bandwidth) and its GPU test
    source scripts/anchor_env.sh > "$OUT/anchor.txt" 2>&1  # FlashMLA for the ratios
    dest=results/kernels/stream_h200; echo "$gpu" | grep -q H200 || dest=results/h100/stream_h100
    timeout 60 python -m pytest -m gpu -rfEs -q -p no:cacheprovider tests/test_stream_probe.py 2>&1 \
      | grep -v "^USDT" | tee "$OUT/pytest_stream.txt" | tail -3
    timeout 200 python scripts/probe_stream.py ${SPINS:+--spins "$SPINS"} --out "$dest" 2>&1 \
      | grep -v "^USDT" | tail -60
    cp "$dest".* "$OUT"/ ;;
  followup)  # what this checkout has not measured on a GPU yet, in one call (~500 s): the split rule's A/B, the
             # stream probe's longer spin sweep, then the GPU suite for what is left of the call
    OUT="$OUT" timeout 130 bash "$0" splits
    OUT="$OUT" timeout 110 bash "$0" stream
    TESTS_S="${TESTS_S:-280}" run_tests ;;
  slot1)  # one slot and three programs per SM (num_stages=1: gluon.narrow exact and native QK, gluon.narrow8 at 16 rows):
          # their GPU tests, then two H = 16 shapes beside the two-slot kernels and FlashMLA (~250 s, any GPU; TEST_S,
          # BENCH_S, SHAPES, VARIANTS shorten it)
    OUT="$OUT/slot1" TAG=slot1 TEST_S="${TEST_S:-90}" TESTS="${TESTS:-follow_the_mma_model or matches_the_reference or one_slot}" \
      BENCH_S="${BENCH_S:-160}" SHAPES="${SHAPES:-128x16x4096,32x16x32768}" \
      VARIANTS="${VARIANTS:-bf16,snapmla,snapmla+gluon+s1,snapmla+gluon+fp8qk,snapmla+gluon+fp8qk+s1,snapmla+gluon+fp8mma16,snapmla+gluon+fp8mma16+s1}" \
      bash scripts/device_widen.sh 2>&1 | tail -24 ;;
  halves)  # gluon.narrow_halves (num_warps=8: two warpgroups split each page's channels): its reference tests, then
           # three H = 16 shapes beside the default and FlashMLA (~200 s, any GPU; TEST_S, BENCH_S, SHAPES shorten it)
    OUT="$OUT/halves" TAG=halves TEST_S="${TEST_S:-60}" TESTS="${TESTS:-matches_the_reference and False-2-8}" \
      BENCH_S="${BENCH_S:-150}" SHAPES="${SHAPES:-128x16x4096,32x16x16384,8x16x32768}" \
      VARIANTS="${VARIANTS:-bf16,snapmla,snapmla+gluon+halves}" bash scripts/device_widen.sh 2>&1 | tail -24 ;;
  profile16)  # ncu of the H = 16 kernels at 128x16x4096: the default, gluon.narrow_halves and FlashMLA (warp states,
              # source hot spots, memory workload) into results/<kernels|h100>/profile16_*.{md,csv} (~200 s; PROFILE_S)
    source scripts/anchor_env.sh > "$OUT/anchor.txt" 2>&1
    dest=results/kernels; echo "$gpu" | grep -q H200 || dest=results/h100
    mkdir -p "$OUT/p16"
    timeout "${PROFILE_S:-230}" python scripts/profile_decode.py run --shapes 128x16x4096 --time-shapes 128x16x4096 \
      --variants snapmla,snapmla+gluon+halves,flashmla --out "$OUT/p16" --ncu-dir "$OUT/p16/ncu" \
      --budget-s "$(( ${PROFILE_S:-230} - 20 ))" --time-budget-s 60 2>&1 | grep -v "^USDT" | tail -12
    for f in "$OUT"/p16/profile_*; do [ -f "$f" ] && cp "$f" "$dest/profile16_${f##*/profile_}"; done
    rm -rf "$OUT/p16/ncu" ;;
  qk8)  # the native e4m3 QK of gluon.narrow against the exact default, its reference tests first
    OUT="$OUT/qk8" TAG=qk8 TEST_S="${TEST_S:-80}" \
      TESTS="follow_the_mma_model or (test_gluon_kernel_matches_the_reference and (qk or True))" \
      BENCH_S="${BENCH_S:-160}" SHAPES="${SHAPES:-128x16x4096,32x16x16384,32x16x32768}" \
      VARIANTS=bf16,snapmla,snapmla+gluon+fp8qk,snapmla+gluon+fp8mma16 bash scripts/device_widen.sh 2>&1 | tail -24 ;;
  all)
    TESTS_S=250 run_tests
    run_decode ;;
  *)
    echo "unknown part '$PART': decode | eval | tests | all | quick | step | splits | stream | followup | slot1 | halves | profile16 | qk8"; exit 2 ;;
esac
exit 0
