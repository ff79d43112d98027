#!/usr/bin/env bash
# The serving report of docs/benchmarks.md: kvserve, vLLM-CPU and llama.cpp on the same model and
# cores, one server at a time (never two under load at once), the same workloads (same seed, so the
# same prompts and arrivals) against each. Then kvserve alone for the prefix-cache scenarios.
# Needs ../shared/peers (each peer installs itself under $PEERS_HOME). Results: $OUT (default bench-results/).
# Usage: scripts/bench_report.sh [engines...]   (default: kvserve vllm llamacpp prefix; also: spec,
# kvserve-fp32 (--dtype float32), vllm-bf16 (vLLM's default dtype))
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results}; mkdir -p "$OUT"
PEERS_HOME=${PEERS_HOME:-$HOME/.cache/kvserve-peers}; export PEERS_HOME
SHARED=${SHARED:-../shared}
K=.venv/bin/kvserve
ENGINES=${*:-kvserve vllm llamacpp prefix}
# $2: the path that answers once the server is up (llama.cpp's server has no /health)
waitport() { for _ in $(seq 1 900); do curl -sf "http://127.0.0.1:$1${2:-/health}" >/dev/null && return 0; sleep 1; done; return 1; }
waitclosed() { for _ in $(seq 1 60); do curl -s "http://127.0.0.1:$1/" >/dev/null || return 0; sleep 1; done; }
date -u +%FT%TZ >> "$OUT/date"

B() { $K bench serve --no-progress "$@"; }
WL=${WL:-c64 single azure interference rag}  # which workloads to run (a subset reruns part of the report)
has() { case " $WL " in *" $1 "*) return 0;; esac; return 1; }
# $1 port, $2 engine name, $3 extra client flags (llama.cpp takes text only)
workloads() {
  local url="http://127.0.0.1:$1" n=$2 x=${3:-}
  has c64 && B --base-url "$url" $x --num-prompts 64 --input-len 128 --output-len 128 --save-result "$OUT/${n}_c64.json"
  has single && B --base-url "$url" $x --num-prompts 3 --max-concurrency 1 --input-len 128 --output-len 256 \
    --save-result "$OUT/${n}_single.json"
  # the first 30 conversation-trace rows replayed 12x slower (~0.13 req/s, ~640-token prompts): a load this CPU sustains
  has azure && B --base-url "$url" $x --dataset azure-conv --num-prompts 30 --time-scale 12 --max-input-len 2048 \
    --max-output-len 128 --save-result "$OUT/${n}_azure_conv.json" --plot "$OUT/${n}_azure_conv.png"
  has interference && B --base-url "$url" $x --dataset interference --cohort 8 --input-len 128 --output-len 200 --burst 2 \
    --burst-len 4000 --burst-output-len 8 --burst-delay 6 --save-result "$OUT/${n}_interference.json" \
    --plot "$OUT/${n}_interference.png"
  has rag && B --base-url "$url" $x --dataset prefix-rag --num-prompts 80 --max-concurrency 8 --output-len 32 \
    --save-result "$OUT/${n}_prefix_rag.json" --plot "$OUT/${n}_prefix_rag.png"
  return 0
}
stop() { kill -TERM "$1" 2>/dev/null; wait "$1" 2>/dev/null; waitclosed "$2"; }

PREFIX_CFGS=${PREFIX_CFGS:-fcfs lpm dfs-weight lpm-host}
for e in $ENGINES; do case $e in
kvserve)
  $K serve --port 8100 & P=$!
  waitport 8100 && workloads 8100 kvserve
  stop $P 8100 ;;
kvserve-fp32)
  $K serve --port 8100 --dtype float32 & P=$!
  waitport 8100 && workloads 8100 kvserve_fp32
  stop $P 8100 ;;
vllm-bf16)  # vLLM-CPU's default dtype: its fastest on a CPU with native bf16 (AVX512-BF16 or AMX)
  "$SHARED/peers/setup-model.sh" >/dev/null
  "$SHARED/peers/vllm-cpu.sh" 8101 --dtype bfloat16 --enable-prompt-tokens-details & P=$!
  waitport 8101 && workloads 8101 vllm_bf16
  kill -TERM $P; sleep 5; pkill -f vllm.entrypoints; waitclosed 8101 ;;
vllm)
  "$SHARED/peers/setup-model.sh" >/dev/null
  "$SHARED/peers/vllm-cpu.sh" 8101 --dtype float32 --enable-prompt-tokens-details & P=$!
  waitport 8101 && workloads 8101 vllm
  kill -TERM $P; sleep 5; pkill -f vllm.entrypoints; waitclosed 8101 ;;
llamacpp)
  "$SHARED/peers/llamacpp.sh" 8102 & P=$!
  waitport 8102 /v1/models && workloads 8102 llamacpp --text-prompts
  stop $P 8102 ;;
prefix)
  # Cache-aware order vs FCFS with a device KV that holds only part of the working set (6 documents
  # of 1,000 tokens behind a 300-token prefix: ~6,300 tokens; the pool: 256 blocks = 4,096 tokens),
  # then lpm with a host tier under it.
  # Poisson arrivals at 1 request/s with no client-side cap, so the server's queue builds and its order matters.
  RAG=(--dataset prefix-rag --num-prompts 48 --request-rate 1 --output-len 32 --system-len 200 --tools-len 100
       --num-docs 6 --doc-len 1000 --question-len 60)
  for cfg in $PREFIX_CFGS; do
    policy=${cfg%-host}; extra=""
    [ "$cfg" = lpm-host ] && extra="--kv-offload-memory-gb 2"
    $K serve --port 8100 --num-kv-blocks 256 --schedule-policy "$policy" $extra & P=$!
    waitport 8100 && B --base-url http://127.0.0.1:8100 "${RAG[@]}" --save-result "$OUT/prefix_${cfg}.json"
    curl -s http://127.0.0.1:8100/metrics | grep -E '^kvserve_(prefix_cache|kv_evicted|kv_offload)' > "$OUT/prefix_${cfg}.metrics"
    stop $P 8100
  done
  [ -n "${SKIP_SCRAMBLED:-}" ] && continue
  # Scrambled prefixes (same content, shuffled pieces) and multi-turn chat, default engine
  $K serve --port 8100 & P=$!
  if waitport 8100; then
    B --base-url http://127.0.0.1:8100 --dataset prefix-rag --scramble --num-prompts 80 --max-concurrency 8 --output-len 32 \
      --save-result "$OUT/kvserve_prefix_rag_scrambled.json"
    curl -s http://127.0.0.1:8100/metrics | grep -E '^kvserve_prefix_cache' > "$OUT/kvserve_after_scrambled.metrics"
    B --base-url http://127.0.0.1:8100 --dataset multi-turn --num-conversations 8 --turns 4 --max-concurrency 8 \
      --save-result "$OUT/kvserve_multi_turn.json"
  fi
  stop $P 8100 ;;
spec)
  # Speculation at high batch: the 64-concurrent random workload with prompt lookup on (adaptive),
  # on with a fixed k (what backing off saves), and off, in turns; then the single-stream grounded task.
  # Greedy (SmolLM2 often loops on random prompts: lookup is right) and at temperature 1 (rarely right).
  for cfg in ${SPEC_CFGS:-off ngram off ngram ngram-fixed off-t1 ngram-t1 ngram-fixed-t1}; do
    case $cfg in off*) extra="";; ngram-fixed*) extra="--speculative-method ngram --no-adaptive-speculation";;
      ngram*) extra="--speculative-method ngram";; esac
    temp=0; case $cfg in *-t1) temp=1;; esac
    $K serve --port 8100 $extra & P=$!
    waitport 8100 && B --base-url http://127.0.0.1:8100 --num-prompts 64 --input-len 128 --output-len 128 \
      --temperature $temp --save-result "$OUT/spec_c64_${cfg}_$(date +%H%M%S).json"
    curl -s http://127.0.0.1:8100/metrics | grep -E '^kvserve_spec_decode' > "$OUT/spec_c64_${cfg}_$(date +%H%M%S).metrics"
    stop $P 8100
  done
  [ -z "${SKIP_SINGLE:-}" ] && .venv/bin/python scripts/bench_spec.py --json "$OUT/spec_single.json"
  true ;;
esac; done
