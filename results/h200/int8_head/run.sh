#!/bin/bash
# One device call (`run.sh LIMIT_S`, default 560): the step with the
# draft's LM head as int8 rows against its native bf16 head, both in one
# process with vanilla (7B + 0.5B shapes, random weights, gamma 4): 32k x
# 16; the GPU checks (greedy speculative decoding with the int8 head equals
# greedy vanilla); a trace of the int8-head step (the head's kernel, launches);
# then, each only where it ends within the limit, on an H200 128k x 8 (it
# does not fit 80 GB), 8k x 16 and 32k x 1. $OUT receives one archive,
# rewritten after each stage.
cd "$(dirname "$0")/../../.."
ARCHIVE=int8_head
. results/h200/device_bench.sh
LIMIT=${1:-560}
H=--draft_heads=native,int8
bench h_c32k16 190 --contexts=32768 --batches=16 --gammas=4 --repeats=6 $H
pack
timeout 70 python3 -m pytest -q -x -p no:cacheprovider tests/test_spec.py tests/test_models.py \
  -k "int8 or greedy_speculative_equals" > "$R/h_pytest.log" 2>&1
echo "pytest rc=$?" >> "$R/h_pytest.log"
pack
if (( SECONDS + 90 < LIMIT )); then
  timeout 90 python3 -m scripts.trace_step --methods=dustin --context=32768 --batch=16 \
    --steps=2 --top=30 --draft_head=int8 --out_dir="$R" --out_name=trace_int8.json \
    > "$R/trace_int8.log" 2>&1
  echo "trace rc=$?" >> "$R/trace_int8.log"
  pack
fi
if (( SECONDS + 200 < LIMIT )) && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bench h_c128k8 200 --contexts=131072 --batches=8 --gammas=4 --repeats=6 $H
  pack
fi
for spec in "h_c8k16 --contexts=8192 --batches=16" "h_c32k1 --contexts=32768 --batches=1"; do
  set -- $spec
  (( SECONDS + 120 < LIMIT )) || break
  name=$1; shift
  bench "$name" 120 "$@" --gammas=4 --repeats=6 $H
  pack
done
grep -h '^{\|^copy' "$R"/h_*.log | cut -c1-420; tail -2 "$R/h_pytest.log"
grep -h "launches\|Decoder.logits" "$R/trace_int8.log" | head -6
