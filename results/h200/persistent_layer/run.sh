#!/bin/bash
# The probe's runs on one GPU, then the package's step traced on the same
# card (the real draft layer-pass); $OUT receives the JSON files and logs.
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv | tee "$OUT/gpu.txt"
run() { echo "== probe.py $*"; timeout 300 python probe.py --out="$OUT" "$@" 2>&1 | grep -v -i "warn"; }
{
run --tag=layers8 --layers=8
run --tag=layers24 --layers=24
run --tag=one_barrier --layers=24 --phases=16
run --tag=eight_barriers --layers=24 --phases=2,2,2,2,2,2,2,2 --variants=barrier,exchange,kernels
run --tag=stages3 --layers=24 --stages=3 --variants=stream,exchange
run --tag=stages10 --layers=24 --stages=10 --variants=stream,exchange
} 2>&1 | tee "$OUT/log.txt"
cd ../../..
python3 -m pip install -q --no-deps --no-index .whl/ml_collections-*.whl > /dev/null 2>&1
timeout 400 python3 -m scripts.trace_step --methods=dustin --context=16384 --batch=16 --steps=2 \
  --top=40 --out_dir="$OUT" 2>&1 | grep -v -i "warn" | tail -15 | tee "$OUT/trace_step.log"
