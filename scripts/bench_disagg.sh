#!/usr/bin/env bash
# docs/scale-out.md's disaggregation table: the interference workload (a decode cohort streams while a
# burst of long prompts arrives) through the router over two replicas of the embedded model, each on a
# core of its own (taskset, --num-threads 1): a colocated pair (--backend x2) against a split (one
# --role prefill, one --role decode replica, --prefill/--decode), replicas restarted before each run,
# the modes taking turns.
# Then the KV transfer cost per 1,000 tokens of the TCP and Redis connectors (scripts/bench_kv_transfer.py).
# Usage: OUT=dir [RUNS=3 COHORT=4 IN=128 OUT_LEN=1500 BURST=2 BURST_LEN=4000 DELAY=5 PY=python] \
#        scripts/bench_disagg.sh [colocated split transfer]
# Run it with PYTHONPATH pointing at the checkout when kvserve is not installed from it.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/disagg}; mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
K="$PY -m kvserve"
RUNS=${RUNS:-3}; COHORT=${COHORT:-4}; IN=${IN:-128}; OUT_LEN=${OUT_LEN:-1500}
BURST=${BURST:-2}; BURST_LEN=${BURST_LEN:-4000}; DELAY=${DELAY:-5}
MODES=${*:-colocated split transfer}
waitport() { for _ in $(seq 1 900); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
{ date -u +%FT%TZ; uptime; lscpu | grep "Model name"; git rev-parse --short HEAD
  echo "RUNS=$RUNS COHORT=$COHORT IN=$IN OUT_LEN=$OUT_LEN BURST=$BURST BURST_LEN=$BURST_LEN DELAY=$DELAY $MODES"; } >> "$OUT/date"
SERVE=(serve --num-threads 1 --kv-cache-memory-gb 1 --max-model-len 8192 --uvicorn-log-level warning)
for run in $(seq 1 "$RUNS"); do  # the modes interleaved, so that the machine's load falls on both alike
  for mode in $MODES; do
    [ "$mode" = transfer ] && continue
    if [ "$mode" = split ]; then roles=(--role\ prefill --role\ decode); else roles=("" ""); fi
    pids=(); core=0
    for port in 8301 8302; do
      # shellcheck disable=SC2086
      taskset -c $core $K "${SERVE[@]}" --port $port --replica-id "r$port" ${roles[$core]} \
        > "$OUT/replica_${port}_${mode}_${run}.log" 2>&1 & pids+=($!)
      core=$((core + 1))
    done
    waitport 8301 && waitport 8302 || { echo "replicas did not start"; kill "${pids[@]}"; exit 1; }
    if [ "$mode" = split ]; then backends=(--prefill http://127.0.0.1:8301 --decode http://127.0.0.1:8302)
    else backends=(--backend http://127.0.0.1:8301 --backend http://127.0.0.1:8302); fi
    $K router --port 8300 --policy least-load --log-level warning "${backends[@]}" > "$OUT/router_${mode}_${run}.log" 2>&1 & rpid=$!
    waitport 8300 || { echo "router did not start"; kill "${pids[@]}" $rpid; exit 1; }
    uptime > "$OUT/${mode}_${run}.uptime"
    $K bench serve --no-progress --base-url http://127.0.0.1:8300 --dataset interference --cohort "$COHORT" \
      --input-len "$IN" --output-len "$OUT_LEN" --burst "$BURST" --burst-len "$BURST_LEN" --burst-delay "$DELAY" \
      --save-result "$OUT/${mode}_${run}.json" > "$OUT/${mode}_${run}.txt" 2>&1
    uptime >> "$OUT/${mode}_${run}.uptime"
    curl -s http://127.0.0.1:8302/metrics | grep -E "^kvserve_(prompt_tokens_total|prefix_cache)" > "$OUT/${mode}_${run}_decode_metrics.txt"
    kill -TERM $rpid "${pids[@]}"; wait $rpid "${pids[@]}" 2>/dev/null
    sleep 2
  done
done
if [[ " $MODES " == *" transfer "* ]]; then
  port=$((6400 + RANDOM % 1000))
  redis-server --port $port --bind 127.0.0.1 --save "" --appendonly no --maxmemory 2gb \
    --maxmemory-policy allkeys-lru > "$OUT/redis.log" 2>&1 & rp=$!
  sleep 1
  $PY scripts/bench_kv_transfer.py --redis-url "redis://127.0.0.1:$port/0" > "$OUT/transfer.txt" 2>&1
  kill $rp; wait $rp 2>/dev/null
fi
