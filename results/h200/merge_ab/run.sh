#!/bin/bash
# One device call (<= 10 min): the window kernel's merge variants checked on
# the GPU (variant.py --check and the compiled merged-in-kernel tests), then
# the step at 32k x 16 (7B + 0.5B shapes, gamma 4, the default window),
# vanilla in each process, for each variant of variant.py, most wanted first,
# then the trace of kernel_merge (launches per step; the default's:
# results/h100/default_window/). Stages that would pass ~9 min are skipped.
# $OUT receives one archive, rewritten after each stage. Expects the
# ml_collections wheel under .whl/ where the device lacks it. The
# kernel_merge variants and the merged-in-kernel tests need the code of
# commit 2c5a446 (elsewhere they stop at once with that message, or select
# no test).
cd "$(dirname "$0")/../../.."
ARCHIVE=merge_ab
. results/h200/device_bench.sh
run_variant() {  # variant module timeout args...
  local v=$1 module=$2 limit=$3; shift 3
  timeout "$limit" python3 results/h200/merge_ab/variant.py --variant="$v" --module="$module" \
    --out_dir="$R" "$@" > "$R/${module}_$v.log" 2>&1
}
python3 results/h200/merge_ab/variant.py --check > "$R/check.log" 2>&1
echo "check rc=$?" >> "$R/check.log"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_window_attention.py \
  tests/kernels/test_sparse_verify_packed.py -k "merged_in_kernel or (compiled_target and merge)" \
  > "$R/pytest.log" 2>&1
echo "pytest rc=$?" >> "$R/pytest.log"
pack
for v in default kernel_merge kernel_merge16 one_reduce splits4; do
  (( SECONDS > 450 )) && break
  run_variant $v bench_e2e 110 --models=qwen7b --methods=vanilla,dustin --phase_batches=16 \
    --contexts=32768 --batches=16 --gammas=4 --repeats=8 --time_budget_s=70 \
    --json_name="e2e_$v.json"
  pack
done
if (( SECONDS < 500 )); then
  run_variant kernel_merge trace_step 80 --methods=dustin --context=32768 --batch=16 --steps=2 \
    --top=40 --out_name="trace_kernel_merge.json"
  pack
fi
tail -3 "$R/check.log" "$R/pytest.log"
grep -h '^{\|^copy' "$R"/bench_e2e_*.log | cut -c1-300
grep -h 'launches$' "$R"/trace_step_*.log
