#!/bin/bash
# One device call (<= 10 min on an H200): the issue's grid at the 16 + 2032-row
# default draft window, most wanted first (a call cut short keeps what it
# measured): 32k x 16, 128k x 8 (an H200 only: it does not fit 80 GB), the GPU
# checks, 32k x 1, 8k x 16, then gamma 3, 5 and 6 at 32k x 16. One process per
# setting, vanilla in the same process, the copy bandwidth measured in each.
# $OUT receives one archive, rewritten after each stage. Expects the
# ml_collections wheel under .whl/ (see device_bench.sh). `grid.sh short`
# (~6 min): only 32k x 16, 128k x 8 and the GPU checks.
cd "$(dirname "$0")/../../.."
ARCHIVE=grid
. results/h200/device_bench.sh
bench g_c32k16 120 --contexts=32768 --batches=16 --gammas=4 --repeats=8
pack
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bench g_c128k8 140 --contexts=131072 --batches=8 --gammas=4 --repeats=6
  pack
fi
# the window kernel at its default tuning against its reference; greedy
# speculative decoding against greedy plain decoding
timeout 90 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_window_attention.py \
  tests/test_spec.py -k "compiled or greedy" > "$R/g_pytest.log" 2>&1
echo "pytest rc=$?" >> "$R/g_pytest.log"
pack
[[ "${1:-}" == short ]] && { grep -h '^{\|^copy' "$R"/g_*.log | cut -c1-300; tail -2 "$R/g_pytest.log"; exit 0; }
bench g_c32k1 80 --contexts=32768 --batches=1 --gammas=4 --repeats=6
pack
bench g_c8k16 80 --contexts=8192 --batches=16 --gammas=4 --repeats=6
pack
bench g_c32k16_g356 150 --contexts=32768 --batches=16 --gammas=3,5,6 --repeats=6
pack
grep -h '^{\|^copy' "$R"/g_*.log | cut -c1-300; tail -2 "$R/g_pytest.log"
