#!/usr/bin/env bash
# offline only: base tree+base .so (B), new tree+new .so (N), new tree+base .so (X), rotating
PY=/work/main/.venv/bin/python; OUT=/tmp/s36/ab3
for round in 1 2 3; do
  for side in B N X; do
    case $side in B) cd /work/wt-base; export -n KVSERVE_KERNEL_CACHE;; N) cd /work/main; export -n KVSERVE_KERNEL_CACHE;; X) cd /work/main; export KVSERVE_KERNEL_CACHE=/tmp/s36/kc;; esac
    $PY -m kvserve bench offline --num-prompts 64 --input-len 128 --output-len 128 --output-json $OUT/${side}_$round.json > $OUT/${side}_$round.log 2>&1
    unset KVSERVE_KERNEL_CACHE
  done
done
echo done > $OUT/done
