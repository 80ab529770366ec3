#!/bin/bash
# One device call (~9 min): the step at 32k x 16 (7B + 0.5B shapes, gamma 4,
# the default window), vanilla in each process, for each merge variant of
# variant.py (default, splits4, one_reduce), then the traces of the two
# variants (launches per step; the default's: results/h100/default_window/).
# $OUT receives one archive, rewritten after each stage. Expects the
# ml_collections wheel under .whl/ where the device lacks it.
cd "$(dirname "$0")/../../.."
ARCHIVE=merge_ab
. results/h200/device_bench.sh
run_variant() {  # variant module timeout args...
  local v=$1 module=$2 limit=$3; shift 3
  timeout "$limit" python3 results/h200/merge_ab/variant.py --variant="$v" --module="$module" \
    --out_dir="$R" "$@" > "$R/${module}_$v.log" 2>&1
}
python3 results/h200/merge_ab/variant.py --check > "$R/check.log" 2>&1
for v in default splits4 one_reduce; do
  run_variant $v bench_e2e 120 --models=qwen7b --methods=vanilla,dustin --phase_batches=16 \
    --contexts=32768 --batches=16 --gammas=4 --repeats=8 --time_budget_s=80 \
    --json_name="e2e_$v.json"
  pack
done
for v in splits4 one_reduce; do
  run_variant $v trace_step 100 --methods=dustin --context=32768 --batch=16 --steps=2 \
    --top=40 --out_name="trace_$v.json"
  pack
done
grep -h '^{\|^copy' "$R"/bench_e2e_*.log | cut -c1-300
grep -h 'launches$' "$R"/trace_step_*.log
