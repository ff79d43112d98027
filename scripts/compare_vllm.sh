#!/usr/bin/env bash
# kvserve vs vLLM-CPU on this machine, one after the other (never both under load at once):
# offline 64x128->128, then the servers: 64 concurrent streams 128->128 and a single stream 128->256.
# Needs ../shared/peers (vLLM-CPU installs itself under $PEERS_HOME). Results go to $OUT (default bench-results/).
# Usage: scripts/compare_vllm.sh [vllm dtype, default float32: vLLM's fastest on AVX2-only CPUs]
set -u
cd "$(dirname "$0")/.."
DTYPE=${1:-float32}
OUT=${OUT:-bench-results}; mkdir -p "$OUT"
PEERS_HOME=${PEERS_HOME:-$HOME/.cache/kvserve-peers}; export PEERS_HOME
SHARED=${SHARED:-../shared}
K=.venv/bin/kvserve
waitport() { for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
waitclosed() { for _ in $(seq 1 60); do curl -s "http://127.0.0.1:$1/health" >/dev/null || return 0; sleep 1; done; }
date -u +%FT%TZ > "$OUT/date"

$K bench offline --num-prompts 64 --input-len 128 --output-len 128 --output-json "$OUT/kvserve_offline.json"

MODEL=$("$SHARED/peers/setup-model.sh" | tail -1)
serve_bench() {  # $1 port, $2 prefix
  $K bench serve --base-url "http://127.0.0.1:$1" --num-prompts 64 --input-len 128 --output-len 128 --save-result "$OUT/$2_c64.json"
  $K bench serve --base-url "http://127.0.0.1:$1" --num-prompts 3 --max-concurrency 1 --input-len 128 --output-len 256 --save-result "$OUT/$2_single.json"
}
$K serve --port 8100 & P=$!
waitport 8100 && serve_bench 8100 kvserve
kill -TERM $P; wait $P; waitclosed 8100

VLLM_CPU_KVCACHE_SPACE=4 "$SHARED/peers/vllm-cpu.sh" 8101 --dtype "$DTYPE" & P=$!
waitport 8101 && serve_bench 8101 vllm
kill -TERM $P; sleep 5; pkill -f vllm.entrypoints; waitclosed 8101

cat > "$OUT/vllm_offline.py" <<'PY'
import json, random, sys, time
from vllm import LLM, SamplingParams
def main():
    llm = LLM(model=sys.argv[2], dtype=sys.argv[1], max_model_len=2048, seed=0)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(128)]} for _ in range(64)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True))
    el = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"engine": "vllm-cpu", "dtype": sys.argv[1], "output_tokens": n, "elapsed_s": round(el, 2),
                      "output_tokens_per_s": round(n / el, 1)}))
if __name__ == "__main__":
    main()
PY
VLLM_CPU_KVCACHE_SPACE=4 "$PEERS_HOME/venv-vllm/bin/python" "$OUT/vllm_offline.py" "$DTYPE" "$MODEL" | tail -1 > "$OUT/vllm_offline.json"

