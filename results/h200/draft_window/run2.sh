#!/bin/bash
# The second device call (~7 min on an H200) beside run.sh: batch 1 at 32k,
# gamma 6 at 32k x 16 (the best gamma), both at the 16 + 2032-row default
# window, and one profiler trace of the dustin step at 32k x 16 (kernel
# launches per step, phases). $OUT receives one archive, rewritten after
# each stage. Expects the ml_collections wheel under .whl/.
cd "$(dirname "$0")/../../.."
ARCHIVE=draft_window2
. results/h200/device_bench.sh
bench w_c32k1 90 --contexts=32768 --batches=1 --gammas=4 --repeats=6 --draft_windows=2032
pack
bench w_c32k16_g6 170 --contexts=32768 --batches=16 --gammas=6 --repeats=6 --draft_windows=2032
pack
timeout 130 python3 -m scripts.trace_step --methods=dustin --context=32768 --batch=16 \
  --steps=2 --top=40 --out_dir="$R" --out_name=trace_step.json > "$R/trace.log" 2>&1
pack
grep -h '^{' "$R"/w_*.log | cut -c1-400; tail -5 "$R/trace.log"
