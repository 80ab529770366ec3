#!/bin/bash
# Two device calls on one H200 (needs_h200; ~8 min each): `run.sh long`, then
# `run.sh grid`. The dustin step with streaming draft caches of 16 sink +
# 496 / 1008 / 2032 recent rows against vanilla, one process per (context,
# batch), each window priced with the tau measured at its own window
# (results/eval/tau.json); $OUT receives one archive of the JSON files and logs.
# Expects the ml_collections wheel under .whl/ (the device has no network).
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.94  # 128k x 8 needs ~114 GiB
R=$OUT; mkdir -p "$R"
python3 -m pip install -q --no-deps --no-index .whl/ml_collections-*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > "$R/gpu.txt" 2>&1
python3 -c "import jax; print(jax.__version__, jax.devices())" >> "$R/gpu.txt" 2>&1
bench() {  # name timeout args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m scripts.bench_e2e --models=qwen7b --methods=vanilla,dustin \
    --phase_batches=16 --time_budget_s=$((limit - 40)) --out_dir="$R" \
    --json_name="$name.json" "$@" > "$R/$name.log" 2>&1
}
case "${1:-grid}" in
  long)  # GPU checks of the 2032-row default; 128k x 8; 32k x 16 at three windows
    timeout 110 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_window_attention.py \
      tests/test_spec.py -k "compiled or greedy" > "$R/w_pytest.txt" 2>&1
    echo "pytest rc=$?" >> "$R/w_pytest.txt"; tail -3 "$R/w_pytest.txt"
    bench w_c128k8 160 --contexts=131072 --batches=8 --gammas=4 --repeats=6 \
      --draft_windows=496,2032
    bench w_c32k16 200 --contexts=32768 --batches=16 --gammas=4 --repeats=8 \
      --draft_windows=496,1008,2032
    ;;
  grid)  # gamma 6 at 32k x 16; 8k and 16k x 16; batch 8 and 1 at 32k
    bench w_c32k16g6 90 --contexts=32768 --batches=16 --gammas=6 --repeats=8 --draft_windows=2032
    bench w_c8k16 90 --contexts=8192 --batches=16 --gammas=4 --repeats=6 --draft_windows=496,2032
    bench w_c16k16 90 --contexts=16384 --batches=16 --gammas=4 --repeats=6 --draft_windows=496,2032
    bench w_c32k8 90 --contexts=32768 --batches=8 --gammas=4 --repeats=6 --draft_windows=496,2032
    bench w_c32k1 80 --contexts=32768 --batches=1 --gammas=4 --repeats=6 --draft_windows=496,2032
    ;;
esac
grep -h '^{' "$R"/w_*.log | cut -c1-300
# at most 8 files come back: the JSONs, logs and plots as one archive
(cd "$R" && tar czf "draft_window_${1:-grid}.tgz" w_* gpu.txt && rm -f w_* gpu.txt)
