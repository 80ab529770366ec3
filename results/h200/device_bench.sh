# Sourced by the device scripts beside it (`. results/h200/device_bench.sh`
# from the repository root, ARCHIVE set to the archive's name): the
# environment, the ml_collections wheel under .whl/ (the device has no
# network), the card and jax into gpu.txt, and
#   bench NAME TIMEOUT ARGS...  scripts.bench_e2e of the 7B + 0.5B pair,
#                               vanilla and dustin in one process, into NAME.json / NAME.log;
#   pack                        every file so far into $OUT/$ARCHIVE.tgz (call it after each
#                               stage: a call cut short still returns what it measured).
# Files are written to $R, a work folder outside $OUT.
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.94  # 128k x 8 needs ~114 GiB
R=$(mktemp -d)
python3 -m pip install -q --no-deps --no-index .whl/ml_collections-*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$R/gpu.txt" 2>&1
python3 -c "import jax; print(jax.__version__, jax.devices())" >> "$R/gpu.txt" 2>&1
bench() {  # name timeout args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m scripts.bench_e2e --models=qwen7b --methods=vanilla,dustin \
    --phase_batches=16 --time_budget_s=$((limit - 40)) --out_dir="$R" \
    --json_name="$name.json" "$@" > "$R/$name.log" 2>&1
}
pack() { (cd "$R" && tar czf "$OUT/${ARCHIVE:?}.tgz" .); }
