#!/bin/bash
# HellaSwag's full validation set (10 042 items) through the engine and lm-eval's hf backend, in shards of
# 1 000 items that survive an interrupted session: a shard whose two JSONs exist is skipped. Each shard
# runs both backends side by side, one thread each (13-24 min per shard on 2 cores). Afterwards, with the
# committed summary of the items before FIRST (its counts are folded in):
#   python benchmarks/smollm2_table.py --merge docs/results/smollm2_hellaswag_6000.json \
#       $OUT/*/engine/smollm2_engine.json $OUT/*/hf/smollm2_hf.json --out /tmp/hs
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-${QUANTGATE_HOME:-$HOME/.cache/quantgate}/hs_shards}
FIRST=${FIRST:-1000}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
for ((a = FIRST; a < 10042; a += 1000)); do
  b=$((a + 1000 > 10042 ? 10042 : a + 1000))
  d=$OUT/${a}_${b}
  if [ -f "$d/engine/smollm2_engine.json" ] && [ -f "$d/hf/smollm2_hf.json" ]; then continue; fi
  mkdir -p "$d/engine" "$d/hf"
  for backend in engine hf; do
    .venv/bin/python benchmarks/smollm2_table.py --tasks hellaswag --docs "$a:$b" --backends $backend \
      --out "$d/$backend" > "$d/$backend.log" 2>&1 &
  done
  wait
  echo "$(date +%T) shard $a:$b done" | tee -a "$OUT/progress.log"
done
