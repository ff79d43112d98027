#!/usr/bin/env bash
# Single-stream decode speed (time per output token), kvserve against llama.cpp on the same GGUF file, interleaved: both servers are up
# (the idle one takes no CPU), and ROUNDS rounds each send NUM 128 -> 128 text prompts to one, then the
# other (the order flips each round), so both see the same memory bandwidth: on a shared VM the
# bandwidth moves between ~45 and ~80 GB/s from one minute to the next, and a ratio of runs minutes
# apart measures the neighbours. A read-bandwidth probe runs before each round.
# Usage: OUT=dir GGUF=/tmp/kvserve-bench-models/Llama-3.2-1B-Instruct.Q8_0.gguf \
#        TOKENIZER=/tmp/kvserve-bench-models/Llama-3.2-1B-Instruct scripts/bench_single_pair.sh
# Summary: python scripts/single_pair_summary.py $OUT
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/single-pair}; mkdir -p "$OUT"
GGUF=${GGUF:?a GGUF file}; TOKENIZER=${TOKENIZER:?the model folder with its tokenizer}
ROUNDS=${ROUNDS:-10}; NUM=${NUM:-1}; LEN=${LEN:-4096}
PEERS_HOME=${PEERS_HOME:-$HOME/.cache/kvserve-peers}
PY=${PY:-.venv/bin/python}; K="$PY -m kvserve"
waitport() { for _ in $(seq 1 900); do curl -sf "http://127.0.0.1:$1${2:-/health}" >/dev/null && return 0; sleep 1; done; return 1; }
{ date -u +%FT%TZ; uptime; lscpu | grep -E "Model name|^Flags" | cut -c1-200; git rev-parse --short HEAD
  echo "GGUF=$GGUF ROUNDS=$ROUNDS NUM=$NUM"; } >> "$OUT/date"

$K serve --model "$GGUF" --port 8100 --max-model-len "$LEN" --uvicorn-log-level warning > "$OUT/kvserve.log" 2>&1 & KP=$!
$PEERS_HOME/venv-llamacpp/bin/python -m llama_cpp.server --model "$GGUF" --model_alias default --host 127.0.0.1 \
  --port 8102 --n_ctx "$LEN" --n_threads "$(nproc)" > "$OUT/llamacpp.log" 2>&1 & LP=$!
trap 'kill -TERM $KP $LP 2>/dev/null; wait $KP $LP 2>/dev/null' EXIT
waitport 8100 && waitport 8102 /v1/models || { echo "a server did not start"; exit 1; }
run() {  # $1 port, $2 name, $3 round
  $K bench serve --no-progress --base-url "http://127.0.0.1:$1" --text-prompts --tokenizer "$TOKENIZER" \
    --num-prompts "$NUM" --max-concurrency 1 --input-len 128 --output-len 128 --seed "$3" \
    --save-result "$OUT/${2}_r$3.json" > /dev/null
}
# one warm-up request each, not recorded
run 8100 warmup-kvserve 0; run 8102 warmup-llamacpp 0
for r in $(seq 1 "$ROUNDS"); do
  $PY -c "import torch,time;torch.set_num_threads($(nproc));a=torch.ones(1<<27);a.sum();t=time.perf_counter();[a.sum() for _ in range(5)];print(f'{5*a.numel()*4/(time.perf_counter()-t)/1e9:.1f}')" \
    > "$OUT/bandwidth_r$r.txt"
  if [ $((r % 2)) = 1 ]; then run 8100 kvserve "$r"; run 8102 llamacpp "$r"
  else run 8102 llamacpp "$r"; run 8100 kvserve "$r"; fi
done
rm -f "$OUT"/warmup-*.json
date -u +%FT%TZ >> "$OUT/date"
$PY scripts/single_pair_summary.py "$OUT" | tee "$OUT/summary.txt"
