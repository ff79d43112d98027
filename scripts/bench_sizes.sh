#!/usr/bin/env bash
# Issue 43's figures at a real model size, on the same dummy weights for every engine, one server at a time:
#   roofline  kvserve bench roofline at batch 1 (int8, int4): the measured read bandwidth, the batch-1
#             ceiling and how close a live decode step gets
#   single    single-stream ITL, 3 x 128 -> 128 text prompts: kvserve and llama.cpp on the same GGUF file
#             (Q8_0, then Q4_0; scripts/write_bench_gguf.py), kvserve keeping its bits (--quantization auto)
#   serve     16 and 64 concurrent 128 -> 128 (CONCURRENCY="16 64"): kvserve (--quantization $KV_QUANTS; empty: none) against
#             vLLM-CPU (--dtype $VLLM_DTYPE; PEERS="" skips it), both --load-format dummy on the config folder
#   goodput   the conversation trace replayed (--time-scale $SCALE), goodput at TTFT <= 2 s and TPOT <= 100 ms
# Folders: python scripts/write_bench_models.py $MODELS (default /tmp/kvserve-bench-models).
# Peers install themselves under $PEERS_HOME (../shared/peers' scripts; run each once first).
# Usage: OUT=dir MODEL=Llama-3.2-1B-Instruct scripts/bench_sizes.sh [roofline single serve goodput]
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/sizes}; mkdir -p "$OUT"
MODEL=${MODEL:-Llama-3.2-1B-Instruct}; MODELS=${MODELS:-/tmp/kvserve-bench-models}; DIR=$MODELS/$MODEL
PEERS_HOME=${PEERS_HOME:-$HOME/.cache/kvserve-peers}
PY=${PY:-.venv/bin/python}; K="$PY -m kvserve"
KV_QUANTS=${KV_QUANTS-auto int8 int4}; CONCURRENCY=${CONCURRENCY:-16 64}; PEERS=${PEERS-vllm}; VLLM_DTYPE=${VLLM_DTYPE:-bfloat16}; SCALE=${SCALE:-12}; TRACE_N=${TRACE_N:-30}; LEN=${LEN:-4096}
STEPS=${*:-roofline single serve goodput}
waitport() { for _ in $(seq 1 900); do curl -sf "http://127.0.0.1:$1${2:-/health}" >/dev/null && return 0; sleep 1; done; return 1; }
waitclosed() { for _ in $(seq 1 60); do curl -s "http://127.0.0.1:$1/" >/dev/null || return 0; sleep 1; done; }
stop() { kill -TERM "$1" 2>/dev/null; wait "$1" 2>/dev/null; waitclosed "$2"; }
B() { $K bench serve --no-progress "$@"; }
{ date -u +%FT%TZ; uptime; lscpu | grep -E "Model name|^Flags" | cut -c1-200; git rev-parse --short HEAD
  echo "MODEL=$MODEL STEPS=$STEPS KV_QUANTS=$KV_QUANTS VLLM_DTYPE=$VLLM_DTYPE"; } >> "$OUT/date"
[ -d "$DIR" ] || $PY scripts/write_bench_models.py "$MODELS" --models "$MODEL"
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }

if has roofline; then
  for q in $KV_QUANTS; do
    $K bench roofline --model "$DIR" --load-format dummy --quantization "$q" --batch 1 --context-len 256 \
      --measure-step --max-model-len "$LEN" > "$OUT/roofline_$q.txt" 2>&1
  done
fi

if has single; then
  for t in q8_0 q4_0; do
    G=$MODELS/$MODEL.${t^^}.gguf
    [ -f "$G" ] || $PY scripts/write_bench_gguf.py "$DIR" --type $t
    $K serve --model "$G" --port 8100 --max-model-len "$LEN" --uvicorn-log-level warning > "$OUT/kvserve_$t.log" 2>&1 & P=$!
    waitport 8100 && B --base-url http://127.0.0.1:8100 --text-prompts --tokenizer "$DIR" --num-prompts 3 \
      --max-concurrency 1 --input-len 128 --output-len 128 --save-result "$OUT/kvserve_${t}_single.json"
    stop $P 8100
    L=$PEERS_HOME/venv-llamacpp/bin/python
    $L -m llama_cpp.server --model "$G" --model_alias default --host 127.0.0.1 --port 8102 --n_ctx "$LEN" \
      --n_threads "$(nproc)" > "$OUT/llamacpp_$t.log" 2>&1 & P=$!
    waitport 8102 /v1/models && B --base-url http://127.0.0.1:8102 --text-prompts --tokenizer "$DIR" --num-prompts 3 \
      --max-concurrency 1 --input-len 128 --output-len 128 --save-result "$OUT/llamacpp_${t}_single.json"
    stop $P 8102
  done
fi

serve_workloads() {  # $1 port, $2 name
  if has serve; then
    for c in $CONCURRENCY; do
      B --base-url "http://127.0.0.1:$1" --num-prompts $c --input-len 128 --output-len 128 --save-result "$OUT/${2}_c$c.json"
    done
  fi
  if has goodput; then
    B --base-url "http://127.0.0.1:$1" --dataset azure-conv --num-prompts "$TRACE_N" --time-scale "$SCALE" --max-input-len 2048 \
      --max-output-len 128 --slo-ttft-ms 2000 --slo-tpot-ms 100 --save-result "$OUT/${2}_goodput.json"
  fi
}
if has serve || has goodput; then
  for q in $KV_QUANTS; do
    $K serve --model "$DIR" --load-format dummy --quantization "$q" --port 8100 --max-model-len "$LEN" \
      --uvicorn-log-level warning > "$OUT/kvserve_serve_$q.log" 2>&1 & P=$!
    waitport 8100 && serve_workloads 8100 "kvserve_$q"
    stop $P 8100
  done
  if [ -n "$PEERS" ]; then
    V=$PEERS_HOME/venv-vllm/bin/python
    VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} $V -m vllm.entrypoints.openai.api_server --model "$DIR" \
      --load-format dummy --served-model-name default --host 127.0.0.1 --port 8101 --dtype "$VLLM_DTYPE" \
      --max-model-len "$LEN" > "$OUT/vllm_serve.log" 2>&1 & P=$!
    waitport 8101 && serve_workloads 8101 "vllm_$VLLM_DTYPE"
    kill -TERM $P; sleep 5; pkill -f vllm.entrypoints; waitclosed 8101
  fi
fi
date -u +%FT%TZ >> "$OUT/date"
