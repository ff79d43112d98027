#!/usr/bin/env bash
# Issue 47's cost check: checkouts side by side in one sitting, rounds alternating. Per side and round:
# `bench offline` (64 x 128 -> 128), `bench offline` of long prompts (4 x 4,000 -> 1: prefill, where the
# deterministic default sends every prompt row to the paged kernel instead of SDPA), and through `serve`:
# `bench serve` c64 (64 x 128 -> 128) and single stream (c1, 8 x 128 -> 128). A side is NAME@DIR[@FLAGS]:
# the checkout DIR run as it is, with engine FLAGS (comma-separated, e.g. --no-deterministic).
# Usage: OUT=dir [ROUNDS="1 2 3"] scripts/bench_determinism.sh NAME@DIR[@FLAGS] ...
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(realpath -m "${OUT:-/tmp/det-bench}"); mkdir -p "$OUT"
PY=${PY:-$ROOT/.venv/bin/python}
waitport() { for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
lscpu | grep "Model name" > "$OUT/cpu"; { date -u +%FT%TZ; uptime; } >> "$OUT/date"
for round in ${ROUNDS:-1 2 3}; do
  for side in "$@"; do
    IFS=@ read -r name dir flags <<< "$side"; flags=${flags//,/ }
    cd "$dir"
    $PY -m kvserve bench offline $flags --num-prompts 64 --input-len 128 --output-len 128 \
      --output-json "$OUT/${name}_offline_$round.json" > "$OUT/${name}_offline_$round.log" 2>&1
    $PY -m kvserve bench offline $flags --num-prompts 4 --input-len 4000 --output-len 1 --max-model-len 8192 \
      --output-json "$OUT/${name}_long_$round.json" > "$OUT/${name}_long_$round.log" 2>&1
    $PY -m kvserve serve $flags --port 8100 > "$OUT/${name}_serve_$round.log" 2>&1 & P=$!
    if waitport 8100; then
      $PY -m kvserve bench serve --no-progress --base-url http://127.0.0.1:8100 --num-prompts 64 \
        --input-len 128 --output-len 128 --save-result "$OUT/${name}_c64_$round.json" > "$OUT/${name}_c64_$round.log" 2>&1
      $PY -m kvserve bench serve --no-progress --base-url http://127.0.0.1:8100 --num-prompts 8 --max-concurrency 1 \
        --input-len 128 --output-len 128 --save-result "$OUT/${name}_c1_$round.json" > "$OUT/${name}_c1_$round.log" 2>&1
    fi
    kill -TERM $P; wait $P 2>/dev/null; sleep 2
  done
done
{ date -u +%FT%TZ; uptime; } >> "$OUT/date"
