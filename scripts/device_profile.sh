#!/usr/bin/env bash
# The decode kernels under Nsight Compute beside FlashMLA's, in one device call (H200; carry .anchors):
#   1. installs FlashMLA from a wheel in .anchors/ (scripts/anchor_env.sh), so its split-KV kernel + combine are
#      profiled and timed beside ours;
#   2. scripts/profile_decode.py run: CUDA-graph timings of our BF16, FP8 default, native FP8 (opt-in) and FlashMLA
#      at the headline shapes plus knob alternatives (split counts, ring slots) past 16 rows; then one ncu report
#      per (shape, variant) at 64x128x8192, 32x64x8192, 128x16x4096 (--clock-control none, --cache-control all,
#      one warm call each), parsed into results/kernels/profile_h200.{md,csv};
#   3. with ANCHOR=1, scripts/device_anchor.sh afterwards (decode benchmark at the 8 headline shapes with FlashMLA,
#      then the end-to-end anchor), its budgets shrunk to the time left of TOTAL_S.
#   SNAPQUANT_GIT_COMMIT=<HEAD hash, written out> ANCHOR=1 bash scripts/device_profile.sh
# Knobs (env): TOTAL_S (560: the whole call), PROFILE_S (330 with ANCHOR=1, else TOTAL_S - 40), NCU (ncu).
# Everything comes back as at most 8 files in $OUT: profile_h200.{md,csv}, profile_timings_h200.csv,
# profile_logs.tar.gz (logs + the CSV exports of every report), ncu_<shape>.tar.gz (that shape's .ncu-rep files,
# open with `ncu-ui` or `ncu --import`), device_anchor.tar.gz (ANCHOR=1).
set -o pipefail
source scripts/commit_env.sh  # the commit the results record (stops here without one)
T0=$(date +%s)
TOTAL_S=${TOTAL_S:-560}
ANCHOR=${ANCHOR:-0}
if [ "$ANCHOR" = 1 ]; then PROFILE_S=${PROFILE_S:-330}; else PROFILE_S=${PROFILE_S:-$((TOTAL_S - 40))}; fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/device_profile}"
NCU_DIR="$(mktemp -d)/ncu"
RES=results/kernels
mkdir -p "$OUT" "$RES" "$NCU_DIR"
elapsed() { echo $(( $(date +%s) - T0 )); }

pack() {  # the reports per shape (each tarball kept under 15 MiB: the largest reports dropped first, logged)
  cp "$RES"/profile_*.md "$RES"/profile_*.csv "$OUT"/ 2>/dev/null  # profile_<h200|h100>.*
  (cd "$NCU_DIR" && tar -czf "$OUT/profile_logs.tar.gz" ./*.log ./*.csv 2>/dev/null)
  for shape in $(cd "$NCU_DIR" && ls ./*.ncu-rep 2>/dev/null | sed 's|^\./||; s|_.*||' | sort -u); do
    mapfile -t reps < <(cd "$NCU_DIR" && ls -S "$shape"_*.ncu-rep)
    while [ ${#reps[@]} -gt 0 ]; do
      (cd "$NCU_DIR" && tar -czf "$OUT/ncu_$shape.tar.gz" "${reps[@]}")
      [ "$(stat -c %s "$OUT/ncu_$shape.tar.gz")" -lt $((15 << 20)) ] && break
      echo "ncu_$shape.tar.gz over 15 MiB: leaving out ${reps[0]} (its CSV exports are in profile_logs.tar.gz)"
      reps=("${reps[@]:1}"); rm -f "$OUT/ncu_$shape.tar.gz"
    done
  done
}
trap pack EXIT

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$NCU_DIR/gpu.log"
# not in a pipeline: a sourced script's exports (PYTHONPATH to FlashMLA) would stay in the pipeline's subshell
source scripts/anchor_env.sh > "$NCU_DIR/flashmla.log" 2>&1; cat "$NCU_DIR/flashmla.log"
"${NCU:-ncu}" --version 2>&1 | tail -1 | tee -a "$NCU_DIR/gpu.log"
timeout $((PROFILE_S + 30)) python3 scripts/profile_decode.py run --out "$RES" --ncu-dir "$NCU_DIR" \
  --ncu "${NCU:-ncu}" --budget-s "$PROFILE_S" 2>&1 | tee "$NCU_DIR/profile.log" | grep -E "^==| us |read bandwidth"
echo "== profile step: $(elapsed) s"
cat "$RES"/profile_h*.md 2>/dev/null | cut -c1-400

if [ "$ANCHOR" = 1 ]; then
  LEFT=$((TOTAL_S - $(elapsed) - 15))  # 15 s for packing
  if [ "$LEFT" -lt 90 ]; then
    echo "== anchor skipped: ${LEFT} s left"
  else
    # the benchmark first (its kernels are compiled by now: ~30-60 s for 8 shapes x 4 variants), the rest to e2e
    BENCH=$(( LEFT * 2 / 5 )); [ "$BENCH" -gt 170 ] && BENCH=170
    export BENCH_BUDGET_S=$((BENCH - 20)) BENCH_TIMEOUT_S=$BENCH
    export E2E_TIMEOUT_S=$((LEFT - BENCH - 10))
    echo "== anchor: ${LEFT} s left; bench budget ${BENCH_BUDGET_S} s (timeout ${BENCH_TIMEOUT_S}), e2e timeout ${E2E_TIMEOUT_S} s"
    mkdir -p "$NCU_DIR/anchor"
    OUT="$NCU_DIR/anchor" bash scripts/device_anchor.sh
    cp "$NCU_DIR/anchor/device_anchor.tar.gz" "$OUT/" 2>/dev/null
    cp "$NCU_DIR"/anchor/*.log "$NCU_DIR"/ 2>/dev/null
  fi
fi
echo "== total: $(elapsed) s"
