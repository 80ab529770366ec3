#!/bin/bash
# The second call: the chain test again (its tolerance now the chain's
# rounding), the drafts end to end at 32k x 16 in one process (on an H100
# the allocator's share raised so that the 66 GiB fit), the default and the
# pdl draft traced with their timelines (does the MLP kernel start before
# the kernel before it ends?).
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.94
R=$OUT; mkdir -p "$R"
python3 -m pip install -q --no-deps --no-index .whl/ml_collections-*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > "$R/gpu.txt" 2>&1
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_swiglu_mlp.py -k "chain" \
  > "$R/pytest.txt" 2>&1; echo "pytest rc=$?" >> "$R/pytest.txt"
timeout 240 python3 -m scripts.bench_e2e --models=qwen7b --contexts=32768 --batches=16 --gammas=4 \
  --methods=vanilla,dustin --draft_mlps=kernel_prefetch,kernel_prefetch_pdl,kernel_prefetch_mosaic \
  --phase_batches=16 --repeats=8 --time_budget_s=190 --out_dir="$R" --json_name=e2e_32k16.json \
  > "$R/e2e.log" 2>&1
for mode in kernel_prefetch kernel_prefetch_pdl; do
  timeout 65 python3 -m scripts.trace_step --methods=dustin --draft_mlp=$mode --context=32768 \
    --batch=16 --steps=2 --top=30 --timeline --out_dir="$R" --out_name=trace_$mode.json \
    > "$R/trace_$mode.log" 2>&1
done
tail -c 600 "$R/pytest.txt"; grep -h '^{' "$R/e2e.log" | cut -c1-300; tail -n 4 "$R/e2e.log"
