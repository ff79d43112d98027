#!/usr/bin/env bash
# docs/img/dashboard.png: two replicas of the embedded model behind `kvserve router`, a real Prometheus
# scraping all three (deploy/prometheus/prometheus.yml's layout on other ports), a few minutes of
# load (prefix-rag through the router, JSON-mode requests, some bad ones), then the Grafana
# dashboard's panels drawn with matplotlib from Prometheus (scripts/render_dashboard.py).
# Usage: [OUT=dir PORT=8300 PROMPTS=48 CONC=4 PNG=docs/img/dashboard.png] scripts/dashboard_demo.sh
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench-results/dashboard}; mkdir -p "$OUT"
PORT=${PORT:-8300}; R1=$((PORT + 1)); R2=$((PORT + 2)); PROM=$((PORT + 90))
PROMPTS=${PROMPTS:-48}; CONC=${CONC:-4}; PNG=${PNG:-docs/img/dashboard.png}
waitport() { for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$1/${2:-health}" >/dev/null && return 0; sleep 1; done; return 1; }
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait 2>/dev/null' EXIT
for port in $R1 $R2; do
  $PY -m kvserve serve --port $port --replica-id "r$port" --num-threads 1 --kv-cache-memory-gb 0.1 \
    --kv-offload-memory-gb 0.5 --speculative-method ngram > "$OUT/replica_$port.log" 2>&1 & pids+=($!)
done
waitport $R1 && waitport $R2 || { echo "replicas did not start"; exit 1; }
$PY -m kvserve router --port "$PORT" --backend "http://127.0.0.1:$R1" --backend "http://127.0.0.1:$R2" \
  > "$OUT/router.log" 2>&1 & pids+=($!)
waitport "$PORT" || { echo "router did not start"; exit 1; }
sed -e "s/127.0.0.1:8001/127.0.0.1:$R1/; s/127.0.0.1:8002/127.0.0.1:$R2/; s/127.0.0.1:8000/127.0.0.1:$PORT/" \
  deploy/prometheus/prometheus.yml > "$OUT/prometheus.yml"
rm -rf "$OUT/tsdb"
prometheus --config.file="$OUT/prometheus.yml" --storage.tsdb.path="$OUT/tsdb" \
  --web.listen-address="127.0.0.1:$PROM" --log.level=warn > "$OUT/prometheus.log" 2>&1 & pids+=($!)
waitport "$PROM" -/ready || { echo "prometheus did not start"; exit 1; }
date -u +%FT%TZ > "$OUT/date"
sleep 20  # an idle stretch first
( for i in $(seq 1 12); do  # JSON mode (the grammar cache: one compile, then hits) and bad requests (400s)
    curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H "Content-Type: application/json" -d \
      '{"messages": [{"role": "user", "content": "A city as JSON, please: '"$i"'"}], "max_tokens": 24,
        "response_format": {"type": "json_object"}}' > /dev/null
    curl -s "http://127.0.0.1:$PORT/v1/completions" -H "Content-Type: application/json" \
      -d '{"prompt": "x", "temperature": -1}' > /dev/null
    sleep 5
  done ) &
side=$!
$PY -m kvserve bench serve --no-progress --base-url "http://127.0.0.1:$PORT" --dataset prefix-rag --num-docs 8 \
  --system-len 256 --tools-len 128 --doc-len 384 --question-len 48 --num-prompts "$PROMPTS" --max-concurrency "$CONC" --output-len 32 --request-rate 0.5 \
  --save-result "$OUT/bench.json" | tail -20
wait $side
sleep 20  # the tail of the load in the rate windows
$PY scripts/render_dashboard.py --prometheus "http://127.0.0.1:$PROM" --scrape-interval 5 \
  --minutes "$(awk -v s="$(date -u -d "$(cat "$OUT/date")" +%s)" -v n="$(date -u +%s)" 'BEGIN {print (n - s) / 60 + 0.2}')" \
  --out "$PNG"
