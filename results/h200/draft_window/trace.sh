#!/bin/bash
# A second device call (~3 min), after grid.sh on the same machine: the
# dustin step at 32k x 16, gamma 4, the default window, traced (launches per
# step, GPU time per kernel and per phase) into $OUT/trace_step.json.
cd "$(dirname "$0")/../../.."
ARCHIVE=trace
. results/h200/device_bench.sh
cp "$R/gpu.txt" "$OUT/gpu.txt"
timeout 240 python3 -m scripts.trace_step --methods=dustin --context=32768 --batch=16 \
  --steps=2 --top=40 --out_dir="$OUT" --out_name=trace_step.json > "$OUT/trace_step.log" 2>&1
echo "trace rc=$?" >> "$OUT/trace_step.log"
tail -3 "$OUT/trace_step.log"
