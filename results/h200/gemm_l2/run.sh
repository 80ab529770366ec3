#!/bin/bash
# One device call (<= 10 min): probe.py's three modes. The autotune-results
# dump and its edit-and-load round trip (the q/k/v chain at 80 rows), then
# the sweep: XLA's pick, cuBLAS and forced Triton configs for the verify's
# q/k/v and o at 80 rows and the draft's at 16, each timed in an L2-cold and
# an L2-warm chain. $OUT receives one archive, rewritten after each stage.
cd "$(dirname "$0")/../../.."
ARCHIVE=gemm_l2
. results/h200/device_bench.sh
P=results/h200/gemm_l2/probe.py
timeout 60 python3 $P --mode=dump --out="$R/dump" > "$R/dump.log" 2>&1
timeout 40 python3 $P --mode=load --file="$R/dump/dump.txtpb" --config=16,64,128,4,4,4 \
  --out="$R/load" > "$R/load.log" 2>&1
pack
timeout 430 python3 $P --mode=sweep --out="$R" --budget_s=370 > "$R/sweep.log" 2>&1
pack
tail -30 "$R/sweep.log"; tail -5 "$R/dump.log" "$R/load.log"
