#!/bin/bash
# One device call (~9 min) on an H200, or an H100 (there 32k x 1 instead of
# 128k x 8, which does not fit 80 GB): the dustin step with a
# streaming draft cache of 16 sink + 496 and 16 sink + 2032 recent rows
# against vanilla, one process per (context, batch), each window priced with
# the tau measured at its own window (results/eval/tau.json); then the GPU
# checks. $OUT receives one archive of the JSON files and logs, rewritten
# after each stage. `run.sh short`: without 8k x 16.
# Expects the ml_collections wheel under .whl/ (see device_bench.sh).
cd "$(dirname "$0")/../../.."
ARCHIVE=draft_window
. results/h200/device_bench.sh
bench w_c32k16 150 --contexts=32768 --batches=16 --gammas=4 --repeats=8 --draft_windows=496,2032
pack
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bench w_c128k8 150 --contexts=131072 --batches=8 --gammas=4 --repeats=6 --draft_windows=496,2032
else
  bench w_c32k1 80 --contexts=32768 --batches=1 --gammas=4 --repeats=6 --draft_windows=496,2032
fi
pack
[[ "${1:-}" == short ]] || { bench w_c8k16 80 --contexts=8192 --batches=16 --gammas=4 --repeats=6 --draft_windows=496,2032; pack; }
grep -h '^{' "$R"/w_*.log | cut -c1-400
# GPU checks: the window kernel at its default tuning against its reference,
# greedy speculative decoding against greedy plain decoding.
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_window_attention.py \
  tests/test_spec.py -k "compiled or greedy" > "$R/w_pytest.log" 2>&1
tail -3 "$R/w_pytest.log"
pack
