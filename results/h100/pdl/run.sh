#!/bin/bash
# One device call (~8 min on an H200): the GPU tests of the MLP kernel with a
# programmatic dependent launch (pdl) and of the drafts that use it or the
# Mosaic window attention, both drafts against the default end to end at
# 32k x 16 in one process, and each one's kernels traced; $OUT receives the
# JSON files and logs. Expects the ml_collections wheel under .whl/.
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD
R=$OUT; mkdir -p "$R"
python3 -m pip install -q --no-deps --no-index .whl/ml_collections-*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > "$R/gpu.txt" 2>&1
python3 -c "import jax; print(jax.__version__, jax.devices())" >> "$R/gpu.txt" 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_swiglu_mlp.py \
  tests/kernels/test_window_attention_mosaic.py tests/test_spec.py -k "compiled or one_kernel" \
  > "$R/pytest.txt" 2>&1; echo "pytest rc=$?" >> "$R/pytest.txt"
timeout 200 python3 -m scripts.bench_e2e --models=qwen7b --contexts=32768 --batches=16 --gammas=4 \
  --methods=vanilla,dustin --draft_mlps=kernel_prefetch,kernel_prefetch_pdl,kernel_prefetch_mosaic \
  --phase_batches=16 --repeats=8 --time_budget_s=170 --out_dir="$R" --json_name=e2e_32k16.json \
  > "$R/e2e.log" 2>&1
for mode in kernel_prefetch_pdl kernel_prefetch_mosaic; do
  timeout 90 python3 -m scripts.trace_step --methods=dustin --draft_mlp=$mode --context=32768 \
    --batch=16 --steps=2 --top=30 --out_dir="$R" --out_name=trace_$mode.json > "$R/trace_$mode.log" 2>&1
done
tail -c 1500 "$R/pytest.txt"; grep -h '^{' "$R/e2e.log" | cut -c1-400; tail -3 "$R"/trace_*.log
