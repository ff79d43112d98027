#!/usr/bin/env bash
# docs/benchmarks.md's "8-bit KV cache" table, in one sitting: accuracy (scripts/bench_kv_dtype.py),
# then speed per --kv-cache-dtype: c64 offline (64 x 128 -> 128) and a 4K-context workload
# (4 x 4000 -> 64), alternating the dtypes so drift in machine load spreads over all of them.
# Usage: [OUT=dir PY=.venv/bin/python] scripts/bench_kv_dtype.sh
set -eu
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/kv-dtype}; mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
{ date -u +%FT%TZ; lscpu | grep 'Model name'; } > "$OUT/sitting"
$PY scripts/bench_kv_dtype.py | tee "$OUT/accuracy.txt"
for kv in auto fp8 int8; do
  $PY -m kvserve bench offline --num-prompts 64 --input-len 128 --output-len 128 --kv-cache-dtype $kv \
    --output-json "$OUT/c64_$kv.json"
done
for kv in auto fp8 int8; do
  $PY -m kvserve bench offline --num-prompts 4 --input-len 4000 --output-len 64 --kv-cache-dtype $kv \
    --output-json "$OUT/ctx4k_$kv.json"
done
