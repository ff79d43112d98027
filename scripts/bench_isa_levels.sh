#!/usr/bin/env bash
# The embedded model's speed at each instruction-set level of the native kernels, forced with
# KVSERVE_CPU_ISA, in one sitting, rounds alternating: `kvserve bench offline` (64 prompts, 128 in,
# 128 out) and `kvserve serve` + `bench serve` c64 (the same shape). A side `NAME@DIR` runs the
# checkout DIR as it is, at its own choice of kernels, under the label NAME (for example
# `native@DIR`: a tree from before per-level libraries, its kernels built with -march=native; or
# `before@DIR`: a worktree of an earlier commit, to measure a kernel change on this CPU).
# Usage: OUT=dir [ROUNDS="1 2 3"] scripts/bench_isa_levels.sh SIDE ...   (SIDE: a level, or NAME@DIR)
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/isa-bench}; mkdir -p "$OUT"
PY=${PY:-$ROOT/.venv/bin/python}
waitport() { for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
lscpu | grep "Model name" > "$OUT/cpu"; date -u +%FT%TZ >> "$OUT/date"
for round in ${ROUNDS:-1 2 3}; do
  for side in "$@"; do
    case $side in
      *@*) dir=${side#*@}; name=${side%%@*}; isa= ;;
      *) dir=$ROOT; name=$side; isa=$side ;;
    esac
    cd "$dir"
    KVSERVE_CPU_ISA=$isa $PY -m kvserve bench offline --num-prompts 64 --input-len 128 --output-len 128 \
      --output-json "$OUT/${name}_offline_$round.json" > "$OUT/${name}_offline_$round.log" 2>&1
    KVSERVE_CPU_ISA=$isa $PY -m kvserve serve --port 8100 > "$OUT/${name}_serve_$round.log" 2>&1 & P=$!
    waitport 8100 && $PY -m kvserve bench serve --no-progress --base-url http://127.0.0.1:8100 --num-prompts 64 \
      --input-len 128 --output-len 128 --save-result "$OUT/${name}_c64_$round.json" > "$OUT/${name}_c64_$round.log" 2>&1
    kill -TERM $P; wait $P 2>/dev/null; sleep 2
  done
done
date -u +%FT%TZ >> "$OUT/date"
