#!/bin/bash
# The probe at the 1B draft's bytes (16 layers; phases q/k/v, attention, o,
# MLP of Llama-3.2-1B at 16 rows), then the package's step traced on the
# same card; $OUT receives one tar of the JSON files and logs.
cd "$(dirname "$0")"
mkdir -p /tmp/res
run() { echo "== probe.py $*"; timeout 300 python probe.py --out=/tmp/res "$@" 2>&1 | grep -v -i "warn"; }
{
run --tag=draft1b --layers=16 --phases=6,8,4,47
run --tag=draft1b_one_barrier --layers=16 --phases=65 --variants=stream,exchange,kernels
} 2>&1 | tee /tmp/res/log_1b.txt
cd ../../..
python3 -m pip install -q --no-deps --no-index .whl/ml_collections-*.whl > /dev/null 2>&1
timeout 400 python3 -m scripts.trace_step --methods=dustin --context=16384 --batch=16 --steps=2 \
  --top=40 --out_dir=/tmp/res 2>&1 | grep -v -i "warn" | tail -15 > /tmp/res/trace_step.log
tar -C /tmp/res -cf "$OUT/results.tar" .
