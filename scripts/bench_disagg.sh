#!/usr/bin/env bash
# docs/scale-out.md's disaggregation table: the interference workload (a decode cohort streams while a
# burst of long prompts arrives) through the router over two replicas of the embedded model, each on a
# core of its own (taskset, --num-threads 1): a colocated pair (--backend x2) against a split (one
# --role prefill, one --role decode replica, --prefill/--decode), replicas restarted before each run,
# the modes taking turns.
# Then the KV transfer cost per 1,000 tokens of the TCP and Redis connectors (scripts/bench_kv_transfer.py).
# The router and the client run on core $FRONT_CORE (default 0, the prefill replica's in a split), so that
# relaying the streams does not take the decode replica's core; FRONT_CORE= leaves them unpinned. Replicas
# run at nice $REPLICA_NICE (default 0), so that with a positive value the router and the client are not
# queued behind a replica's step on the core they share.
# Usage: OUT=dir [RUNS=3 FIRST_RUN=1 COHORT=4 IN=128 OUT_LEN=1500 BURST=2 BURST_LEN=4000 DELAY=5 FRONT_CORE=0 PY=python] \
#        scripts/bench_disagg.sh [colocated split colocated-alone split-alone transfer]
# A mode's -alone runs send the cohort without the burst: their ITL p99 over the burst runs' window is the
# baseline (the same stream positions: the cohort's contexts grow, which slows its steps burst or not).
# Run it with PYTHONPATH pointing at the checkout when kvserve is not installed from it.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/disagg}; mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
K="$PY -m kvserve"
RUNS=${RUNS:-3}; COHORT=${COHORT:-4}; IN=${IN:-128}; OUT_LEN=${OUT_LEN:-1500}
BURST=${BURST:-2}; BURST_LEN=${BURST_LEN:-4000}; DELAY=${DELAY:-5}
MODES=${*:-colocated split colocated-alone split-alone transfer}
REPLICA_NICE=${REPLICA_NICE:-0}
FRONT_CORE=${FRONT_CORE-0}; FRONT=(); [ -n "$FRONT_CORE" ] && FRONT=(taskset -c "$FRONT_CORE")
waitport() { for _ in $(seq 1 900); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
{ date -u +%FT%TZ; uptime; lscpu | grep "Model name"; git rev-parse --short HEAD
  echo "RUNS=$RUNS COHORT=$COHORT IN=$IN OUT_LEN=$OUT_LEN BURST=$BURST BURST_LEN=$BURST_LEN DELAY=$DELAY FRONT_CORE=$FRONT_CORE REPLICA_NICE=$REPLICA_NICE $MODES"; } >> "$OUT/date"
SERVE=(serve --num-threads 1 --kv-cache-memory-gb 1 --max-model-len 8192 --uvicorn-log-level warning)
for run in $(seq "${FIRST_RUN:-1}" "$RUNS"); do  # the modes interleaved, so that the machine's load falls on both alike
  for mode in $MODES; do
    [ "$mode" = transfer ] && continue
    burst=$BURST; case $mode in *-alone) burst=0;; esac  # the cohort alone: the baseline of the burst's window
    if [ "${mode%-alone}" = split ]; then roles=(--role\ prefill --role\ decode); else roles=("" ""); fi
    pids=(); core=0
    for port in 8301 8302; do
      # shellcheck disable=SC2086
      nice -n "$REPLICA_NICE" taskset -c $core $K "${SERVE[@]}" --port $port --replica-id "r$port" ${roles[$core]} \
        > "$OUT/replica_${port}_${mode}_${run}.log" 2>&1 & pids+=($!)
      core=$((core + 1))
    done
    waitport 8301 && waitport 8302 || { echo "replicas did not start"; kill "${pids[@]}"; exit 1; }
    if [ "${mode%-alone}" = split ]; then backends=(--prefill http://127.0.0.1:8301 --decode http://127.0.0.1:8302)
    else backends=(--backend http://127.0.0.1:8301 --backend http://127.0.0.1:8302); fi
    "${FRONT[@]}" $K router --port 8300 --policy least-load --log-level warning "${backends[@]}" > "$OUT/router_${mode}_${run}.log" 2>&1 & rpid=$!
    waitport 8300 || { echo "router did not start"; kill "${pids[@]}" $rpid; exit 1; }
    uptime > "$OUT/${mode}_${run}.uptime"
    "${FRONT[@]}" $K bench serve --no-progress --base-url http://127.0.0.1:8300 --dataset interference --cohort "$COHORT" \
      --input-len "$IN" --output-len "$OUT_LEN" --burst "$burst" --burst-len "$BURST_LEN" --burst-delay "$DELAY" \
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
