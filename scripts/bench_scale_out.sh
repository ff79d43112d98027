#!/usr/bin/env bash
# docs/scale-out.md's table: prefix-rag over 2 replicas behind `kvserve router`, one run per policy,
# the replicas restarted (cold caches) before each. Each replica gets one core (--num-threads 1) and
# a KV pool that holds about half of the workload's shared working set beside its running requests.
# Usage: OUT=dir [KV_GB=0.5 PROMPTS=64 DOCS=16 CONC=4 ROUTER_ARGS=...] scripts/bench_scale_out.sh [policies...]
# (default policies: round-robin least-load cache-aware)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/scale-out}; mkdir -p "$OUT"
K=.venv/bin/kvserve
POLICIES=${*:-round-robin least-load cache-aware}
KV_GB=${KV_GB:-0.5}; PROMPTS=${PROMPTS:-64}; DOCS=${DOCS:-16}; CONC=${CONC:-4}
waitport() { for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
date -u +%FT%TZ >> "$OUT/date"
for policy in $POLICIES; do
  pids=()
  for port in 8201 8202; do
    $K serve --port $port --replica-id "r$port" --num-threads 1 --kv-cache-memory-gb "$KV_GB" \
      > "$OUT/replica_${port}_${policy}.log" 2>&1 & pids+=($!)
  done
  waitport 8201 && waitport 8202 || { echo "replicas did not start"; kill "${pids[@]}"; exit 1; }
  $K router --port 8200 --policy "$policy" ${ROUTER_ARGS:-} --backend http://127.0.0.1:8201 --backend http://127.0.0.1:8202 \
    > "$OUT/router_${policy}.log" 2>&1 & rpid=$!
  waitport 8200 || { echo "router did not start"; kill "${pids[@]}" $rpid; exit 1; }
  $K bench serve --no-progress --base-url http://127.0.0.1:8200 --dataset prefix-rag --num-docs "$DOCS" \
    --num-prompts "$PROMPTS" --max-concurrency "$CONC" --output-len 16 --save-result "$OUT/${policy}.json"
  curl -s http://127.0.0.1:8200/metrics | grep -E "router_(predicted|reported)_cached_tokens_total|router_prompt_tokens_total|router_requests_total" \
    > "$OUT/router_metrics_${policy}.txt"
  kill -TERM $rpid "${pids[@]}"; wait $rpid "${pids[@]}" 2>/dev/null
  sleep 2
done
