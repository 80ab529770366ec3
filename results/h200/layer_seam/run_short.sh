#!/bin/bash
# A shorter call (~5.5 min): the seam drafts against the default end to end
# at 32k x 16 in one process, then the seam and Mosaic window kernels' GPU
# tests, then the one-pass probe; $OUT receives the JSON files and logs.
# Expects the ml_collections wheel under .whl/ (the device has no network).
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.94
R=$OUT; mkdir -p "$R"
python3 -m pip install -q --no-deps --no-index .whl/ml_collections-*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > "$R/gpu.txt" 2>&1
timeout 170 python3 -m scripts.bench_e2e --models=qwen7b --contexts=32768 --batches=16 --gammas=4 \
  --methods=vanilla,dustin --draft_mlps=kernel_prefetch,seam_mosaic,seam --phase_batches=16 \
  --repeats=8 --time_budget_s=140 --out_dir="$R" --json_name=e2e_32k16.json > "$R/e2e.log" 2>&1
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_window_attention_mosaic.py \
  tests/kernels/test_layer_seam.py tests/test_spec.py -k "compiled or decoder or one_kernel" \
  > "$R/pytest.txt" 2>&1; echo "pytest rc=$?" >> "$R/pytest.txt"
timeout 70 python3 results/h200/layer_seam/probe.py --out="$R/ls" --stages=4 > "$R/ls.log" 2>&1
tail -c 800 "$R/pytest.txt"; grep -h '^{' "$R/e2e.log" | cut -c1-300
