#!/usr/bin/env bash
# The research model on one H200 in two back-to-back device calls (< 10 minutes each; the second must
# reach the same machine, whose disk holds the checkpoint):
#   bash scripts/device_research.sh 1   # data (machine corpus) + measure + train + eval + activation study
#   bash scripts/device_research.sh 2   # FP8 analyses with intervals
#   bash scripts/device_research.sh 3   # (optional) resume whatever analyses call 2 had no time for
# State (corpus, checkpoint, bf16 model) lives in runs/research_model/ on the machine's disk
# between calls; each call leaves in $OUT: its log and research_results.tar.gz (the results
# folder so far: model card, JSON/CSV, figures) -- unpack with
#   tar -xzf research_results.tar.gz -C results/research_model
set -o pipefail
source scripts/commit_env.sh  # the commit the results record (stops here without one)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CALL="${1:?usage: device_research.sh 1|2|3}"
OUT="${OUT:-/tmp/research_out}"
mkdir -p "$OUT"
STATE=runs/research_model
RES=$STATE/results
S=scripts/train_research_model.py
pack() { tar -czf "$OUT/research_results.tar.gz" -C "$RES" . 2>/dev/null; cp -f "$RES/research_log.jsonl" "$OUT/" 2>/dev/null; }
trap pack EXIT
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu_call$CALL.txt"
case "$CALL" in
  # ~555 s: data (scan + decontaminate + tokenize, ~60 s), speed measurement, train the planned steps
  # (2K rows, the last 30% of the steps 8K rows), then held-out perplexity, the task-difficulty grid
  # and the activation study (~140 s kept).
  1) timeout 575 python $S data train eval study --state $STATE --out $RES --budget-s 555 --train-later-s 0 \
       --after-train-s 140 --no-embedded-tasks 2>&1 | tee "$OUT/call1.log" ;;
  # ~470 s: analyses (agreement, fidelity parts, tasks under FP8, long context; each part is saved as it
  # finishes; what has no time left is logged as skipped and call 3 resumes it).
  2) timeout 490 python $S eval study analyses --state $STATE --out $RES --budget-s 470 2>&1 | tee "$OUT/call2.log" ;;
  # ~490 s: resume the analyses (a rerun continues where call 2 stopped), card and figures.
  3) timeout 575 python $S analyses --state $STATE --out $RES --budget-s 550 2>&1 | tee "$OUT/call3.log" ;;
  *) echo "unknown call $CALL (1, 2 or 3)"; exit 2 ;;
esac
rc=$?
df -h "$STATE" | tail -1
exit $rc
