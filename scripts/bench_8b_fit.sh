#!/usr/bin/env bash
# Issue 43's memory check: Llama-3.1-8B-Instruct (dummy weights) at --quantization int4 serving with a KV
# cache on this 24 GB machine. Prints the start-up log's memory lines, the engine's peak RSS (VmHWM) and the
# answer's timings for one request. Usage: OUT=dir [MODELS=/tmp/kvserve-bench-models KV_GB=2] scripts/bench_8b_fit.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/8b-fit}; mkdir -p "$OUT"
MODELS=${MODELS:-/tmp/kvserve-bench-models}; DIR=$MODELS/Llama-3.1-8B-Instruct; KV_GB=${KV_GB:-2}
PY=${PY:-.venv/bin/python}
[ -d "$DIR" ] || $PY scripts/write_bench_models.py "$MODELS" --models Llama-3.1-8B-Instruct
{ date -u +%FT%TZ; free -g | head -2; } > "$OUT/fit.txt"
start=$(date +%s)
$PY -m kvserve serve --model "$DIR" --load-format dummy --quantization int4 --max-model-len 8192 \
  --kv-cache-memory-gb "$KV_GB" --port 8100 --uvicorn-log-level warning > "$OUT/serve.log" 2>&1 & P=$!
peak=0
for _ in $(seq 1 1200); do
  for c in $(pgrep -P $P) $P; do
    kb=$(awk '/VmHWM/ {print $2}' /proc/$c/status 2>/dev/null); [ -n "$kb" ] && [ "$kb" -gt "$peak" ] && peak=$kb
  done
  curl -sf http://127.0.0.1:8100/health >/dev/null && break
  kill -0 $P 2>/dev/null || break
  sleep 1
done
echo "ready after $(( $(date +%s) - start )) s; engine peak RSS so far $((peak / 1024)) MiB" >> "$OUT/fit.txt"
$PY -m kvserve bench serve --no-progress --base-url http://127.0.0.1:8100 --num-prompts 2 --max-concurrency 1 \
  --input-len 128 --output-len 32 --save-result "$OUT/single.json" >> "$OUT/fit.txt" 2>&1
for c in $(pgrep -P $P) $P; do
  kb=$(awk '/VmHWM/ {print $2}' /proc/$c/status 2>/dev/null); [ -n "$kb" ] && [ "$kb" -gt "$peak" ] && peak=$kb
done
echo "engine peak RSS $((peak / 1024)) MiB" >> "$OUT/fit.txt"
grep -E "model weights|KV blocks|dummy weights" "$OUT/serve.log" >> "$OUT/fit.txt"
kill -TERM $P; wait $P
free -g | head -2 >> "$OUT/fit.txt"
