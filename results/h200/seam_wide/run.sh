#!/bin/bash
# One device call (~9 min on an H200): (1) the dustin step with its draft's
# first pass of each step (32 rows at batch 16) through the seam kernel
# (draft_mlp "seam_wide") against the layer-by-layer default
# ("kernel_prefetch"), each at 16 + 496 and 16 + 2032 window rows, vanilla
# in the same process (32k x 16); (2) a one-pass probe of the seam kernel
# with its rows padded from 16 to 32; (3) the GPU checks; (4) 128k x 8 on an
# H200 (32k x 1 on an H100, where 128k x 8 does not fit). $OUT receives one
# archive of the JSON files and logs, rewritten after each stage.
# Expects the ml_collections wheel under .whl/ (see device_bench.sh).
cd "$(dirname "$0")/../../.."
OUT_FINAL=$OUT; OUT=$(mktemp -d)  # the work here, one archive in $OUT_FINAL after each stage
. results/h200/device_bench.sh
pack() { (cd "$R" && tar czf "$OUT_FINAL/seam_wide.tgz" .); }
bench s_c32k16 $([[ "${1:-}" == min ]] && echo 170 || echo 200) --contexts=32768 --batches=16 --gammas=4 --repeats=8 \
  --draft_windows=496,2032 --draft_mlps=kernel_prefetch,seam_wide
pack
# one 0.5B draft pass: the seam at 16 rows, padded to 32, against the default
[[ "${1:-}" == min ]] || timeout 100 python3 results/h200/layer_seam/probe.py --out="$R/s_probe" --tokens=1,2 --stages=4 \
  --pad_rows=8,32 --mosaic=0 > "$R/s_probe.log" 2>&1
pack
# GPU checks: the window kernel at its default tuning against its reference,
# greedy speculative decoding against greedy plain decoding (seam drafts included).
timeout $([[ "${1:-}" == min ]] && echo 60 || echo 110) python3 -m pytest -q -p no:cacheprovider tests/kernels/test_window_attention.py \
  tests/test_spec.py tests/kernels/test_layer_seam.py -k "compiled or greedy or seam" > "$R/s_pytest.log" 2>&1
tail -3 "$R/s_pytest.log"
pack
if [[ "${1:-}" == short || "${1:-}" == min ]]; then
  :  # `run.sh short`: stages 1-3 only; `run.sh min`: 1 and 3
elif nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bench s_c128k8 140 --contexts=131072 --batches=8 --gammas=4 --repeats=6 --draft_windows=496,2032
else
  bench s_c32k1 80 --contexts=32768 --batches=1 --gammas=4 --repeats=6 --draft_windows=496,2032
fi
pack
grep -h '^{' "$R"/s_*.log | cut -c1-300
