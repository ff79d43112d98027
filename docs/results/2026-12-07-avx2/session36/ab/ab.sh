#!/usr/bin/env bash
# A/B of the embedded model's speed: base (b4ecfbe, before sessions 35-36) vs new (this session's tree), alternating, one sitting.
set -u
OUT=${OUT:-/tmp/ab}; mkdir -p "$OUT"
PY=/work/main/.venv/bin/python
waitport() { for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
lscpu | grep "Model name" > "$OUT/cpu"; date -u +%FT%TZ >> "$OUT/date"
for round in ${ROUNDS:-1 2}; do
  for side in ${ORDER:-base new}; do
    dir=/work/wt-base; [ $side = new ] && dir=/work/main
    cd "$dir"
    $PY -m kvserve bench offline --num-prompts 64 --input-len 128 --output-len 128 --output-json "$OUT/${side}_offline_$round.json" > "$OUT/${side}_offline_$round.log" 2>&1
    $PY -m kvserve serve --port 8100 > "$OUT/${side}_serve_$round.log" 2>&1 & P=$!
    waitport 8100 && $PY -m kvserve bench serve --no-progress --base-url http://127.0.0.1:8100 --num-prompts 64 --input-len 128 --output-len 128 --save-result "$OUT/${side}_c64_$round.json" > "$OUT/${side}_c64_$round.log" 2>&1
    kill -TERM $P; wait $P 2>/dev/null; sleep 2
  done
done
date -u +%FT%TZ >> "$OUT/date"
