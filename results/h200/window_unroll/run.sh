#!/bin/bash
# One device call (<= 10 min): probe.py (the window and listed attention
# kernel's tunings with `unroll`, at the step's shapes, each against its
# reference), then the step at 32k x 16 (7B + 0.5B shapes, gamma 4,
# vanilla in each process) with probe.py's fastest tunings (variant.py) and
# with the shipped ones, on an H200 the shipped step at 128k x 8 (it does
# not fit 80 GB), then the compiled tests of the new knob, each stage only
# where it ends within the call's limit (`run.sh LIMIT_S`, default 400).
# $OUT receives one archive, rewritten after each stage.
cd "$(dirname "$0")/../../.."
ARCHIVE=window_unroll
. results/h200/device_bench.sh
D=results/h200/window_unroll
LIMIT=${1:-400}
timeout 140 python3 $D/probe.py --out="$R" > "$R/probe.log" 2>&1
echo "probe rc=$?" >> "$R/probe.log"
pack
i=0
for v in best default; do
  (( SECONDS + 95 > LIMIT )) && break
  i=$((i + 1))
  timeout 110 python3 $D/variant.py --variant=$v --best="$R/best.json" --module=bench_e2e \
    --models=qwen7b --methods=vanilla,dustin --phase_batches=16 --contexts=32768 \
    --batches=16 --gammas=4 --repeats=6 --time_budget_s=60 --compile_cache= \
    --out_dir="$R" --json_name="e2e_${i}_$v.json" > "$R/bench_e2e_${i}_$v.log" 2>&1
  pack
done
if (( SECONDS + 150 < LIMIT )) && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bench g_c128k8 140 --contexts=131072 --batches=8 --gammas=4 --repeats=6
  pack
fi
if (( SECONDS + 60 < LIMIT )); then
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_window_attention.py \
    tests/kernels/test_sparse_verify_packed.py -k "compiled_unrolled or (compiled_target and unroll)" \
    > "$R/pytest.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest.log"
  pack
fi
grep -h "best\|rc=" "$R/probe.log" | cut -c1-400; tail -2 "$R/pytest.log"
grep -h '^{\|^copy\|^variant' "$R"/bench_e2e_*.log "$R"/g_*.log 2>/dev/null | cut -c1-300
