#!/usr/bin/env bash
# The tests that run native code, once per instruction-set level this CPU can run below its best (the
# whole suite ran the best), each forced with KVSERVE_CPU_ISA: no kernel path ships untested.
# Usage: scripts/test_isa_levels.sh PYTHON [pytest args ...]     (ISA_LEVELS="avx2 avx512" picks levels)
set -euo pipefail
PY=$1; shift
LEVELS=${ISA_LEVELS:-$("$PY" -c "
from kvserve.kernels import isa
best = isa.best_level()
print(' '.join(lv.name for lv in isa.LEVELS if best and lv != best and not isa.missing(lv)))")}
TESTS=(tests/kernels tests/sampling tests/engine/test_engine_tiny.py tests/engine/test_kv8_features.py
       tests/model/test_architectures.py tests/model/test_native_stack.py tests/model/test_paged_backend.py
       tests/model/test_quantization.py tests/model/test_sliding_window_kv.py tests/model/test_kv8_accuracy.py
       tests/model/test_e2e_embedded.py)
[ -n "$LEVELS" ] || { echo "test-isa: this CPU runs no level below its best"; exit 0; }
for LEVEL in $LEVELS; do
  echo "test-isa: KVSERVE_CPU_ISA=$LEVEL"
  KVSERVE_CPU_ISA=$LEVEL "$PY" -m pytest -q "$@" "${TESTS[@]}"
done
