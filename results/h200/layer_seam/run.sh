#!/bin/bash
# One device call (~9 min on an H200): the GPU tests of the seam and the
# Mosaic window kernel, the seam kernel's phases profiled, the one-pass
# probe, the seam draft's kernels traced and
# the draft variants end to end at 32k x 16; $OUT receives the JSON files and logs.
# Expects the ml_collections wheel under .whl/ (the device has no network).
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.94  # an H100 holds 32k x 16 only so
R=$OUT; mkdir -p "$R"
python3 -m pip install -q --no-deps --no-index .whl/ml_collections-*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > "$R/gpu.txt" 2>&1
python3 -c "import jax; print(jax.__version__, jax.devices())" >> "$R/gpu.txt" 2>&1
timeout 130 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_window_attention_mosaic.py \
  tests/kernels/test_layer_seam.py tests/test_spec.py -k "compiled or decoder or one_kernel" \
  > "$R/pytest.txt" 2>&1; echo "pytest rc=$?" >> "$R/pytest.txt"
timeout 80 python3 results/h200/layer_seam/profile_probe.py --out="$R/prof" > "$R/prof.log" 2>&1
timeout 100 python3 results/h200/layer_seam/probe.py --out="$R/ls" --stages=4 > "$R/ls.log" 2>&1
timeout 80 python3 -m scripts.trace_step --methods=dustin --draft_mlp=seam --context=32768 \
  --batch=16 --steps=2 --top=30 --out_dir="$R" --out_name=trace_seam.json > "$R/trace.log" 2>&1
timeout 170 python3 -m scripts.bench_e2e --models=qwen7b --contexts=32768 --batches=16 --gammas=4 \
  --methods=vanilla,dustin --draft_mlps=kernel_prefetch,seam,seam_mosaic --phase_batches=16 \
  --repeats=8 --time_budget_s=130 --out_dir="$R" --json_name=e2e_32k16.json > "$R/e2e.log" 2>&1
tail -c 1500 "$R/pytest.txt"; grep -h '^{' "$R/prof.log" "$R/ls.log" "$R/e2e.log" | cut -c1-400
