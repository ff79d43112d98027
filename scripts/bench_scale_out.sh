#!/usr/bin/env bash
# docs/scale-out.md's table: prefix-rag over 2 replicas behind a router, one run per policy, the
# replicas restarted (cold caches) before each. Each replica gets one core (--num-threads 1) and a KV
# pool that holds about half of the workload's shared working set beside its running requests.
# Usage: OUT=dir [KV_GB=0.5 PROMPTS=64 DOCS=16 CONC=4 ROUTER_ARGS=... TEXT=1 WARMUP=N] \
#        scripts/bench_scale_out.sh [policies...]
# Policies: round-robin least-load cache-aware session (kvserve router), and sglang-router (PyPI
# sglang-router's cache_aware policy in front of the same replicas; it takes only text prompts, so
# its row always sends text: compare it with rows run with TEXT=1).
# TEXT=1: send prompts as text (bench serve --text-prompts). WARMUP=N: before the measured run, its
# first N requests once, not counted (the prompts are made from the seed, so the measured run repeats
# them): the tail is then the steady state's rather than the cold start's. Or make the cold start
# under 1% of the run: PROMPTS=800. (default policies: round-robin least-load cache-aware)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/scale-out}; mkdir -p "$OUT"
K=.venv/bin/kvserve
PY=.venv/bin/python
POLICIES=${*:-round-robin least-load cache-aware}
KV_GB=${KV_GB:-0.5}; PROMPTS=${PROMPTS:-64}; DOCS=${DOCS:-16}; CONC=${CONC:-4}; WARMUP=${WARMUP:-0}
waitport() { for _ in $(seq 1 900); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
{ date -u +%FT%TZ; lscpu | grep "Model name"; echo "KV_GB=$KV_GB PROMPTS=$PROMPTS DOCS=$DOCS CONC=$CONC WARMUP=$WARMUP TEXT=${TEXT:-} ROUTER_ARGS=${ROUTER_ARGS:-} $POLICIES"; } >> "$OUT/date"
for policy in $POLICIES; do
  pids=()
  for port in 8201 8202; do
    $K serve --port $port --replica-id "r$port" --num-threads 1 --kv-cache-memory-gb "$KV_GB" \
      > "$OUT/replica_${port}_${policy}.log" 2>&1 & pids+=($!)
  done
  waitport 8201 && waitport 8202 || { echo "replicas did not start"; kill "${pids[@]}"; exit 1; }
  extra=()
  [ -n "${TEXT:-}" ] && extra+=(--text-prompts)
  if [ "$policy" = sglang-router ]; then
    $PY -m sglang_router.launch_router --host 127.0.0.1 --port 8200 --policy cache_aware --log-level warn \
      --worker-urls http://127.0.0.1:8201 http://127.0.0.1:8202 > "$OUT/router_${policy}.log" 2>&1 & rpid=$!
    # it rejects token-id prompts, and its /v1/models does not know the replicas' model name
    model=$(curl -s http://127.0.0.1:8201/v1/models | $PY -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
    extra=(--text-prompts --model "$model")
  else
    $K router --port 8200 --policy "$policy" ${ROUTER_ARGS:-} --backend http://127.0.0.1:8201 --backend http://127.0.0.1:8202 \
      > "$OUT/router_${policy}.log" 2>&1 & rpid=$!
  fi
  waitport 8200 || { echo "router did not start"; kill "${pids[@]}" $rpid; exit 1; }
  if [ "$WARMUP" -gt 0 ]; then
    $K bench serve --no-progress --base-url http://127.0.0.1:8200 --dataset prefix-rag --num-docs "$DOCS" \
      --num-prompts "$WARMUP" --max-concurrency "$CONC" --output-len 16 "${extra[@]}" > "$OUT/warmup_${policy}.txt"
  fi
  $K bench serve --no-progress --base-url http://127.0.0.1:8200 --dataset prefix-rag --num-docs "$DOCS" \
    --num-prompts "$PROMPTS" --max-concurrency "$CONC" --output-len 16 "${extra[@]}" --save-result "$OUT/${policy}.json"
  if [ "$policy" != sglang-router ]; then
    curl -s http://127.0.0.1:8200/metrics | grep -E "router_(predicted|reported)_cached_tokens_total|router_prompt_tokens_total|router_requests_total" \
      > "$OUT/router_metrics_${policy}.txt"
  fi
  kill -TERM $rpid "${pids[@]}"; wait $rpid "${pids[@]}" 2>/dev/null
  sleep 2
done
