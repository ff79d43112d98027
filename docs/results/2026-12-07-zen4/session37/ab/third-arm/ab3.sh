#!/usr/bin/env bash
# offline only: base tree+base .so (B), new tree+new .so (N), new tree+base .so (X: KVSERVE_KERNEL_CACHE at a folder
# whose avx512_bf16 entry under the new key links to the base library), rotating the order each round
PY=/work/main/.venv/bin/python; OUT=${OUT:-/tmp/s37/ab3}; mkdir -p "$OUT"
for round in 1 2 3 4; do
  case $round in 1) order="B N X";; 2) order="N X B";; 3) order="X B N";; 4) order="B X N";; esac
  for side in $order; do
    case $side in B) dir=/work/wt-base; kc=;; N) dir=/work/main; kc=;; X) dir=/work/main; kc=/tmp/s37/kc;; esac
    (cd $dir && KVSERVE_KERNEL_CACHE=$kc $PY -m kvserve bench offline --num-prompts 64 --input-len 128 --output-len 128 \
       --output-json "$OUT/${side}_$round.json" > "$OUT/${side}_$round.log" 2>&1)
  done
done
