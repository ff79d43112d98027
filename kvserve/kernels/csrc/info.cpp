// kvserve::simd_level() -> "avx512" | "avx2" | "scalar": which vector path this build compiled.
#include "common.h"

static std::string simd_level() { return KVSERVE_SIMD; }

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("simd_level() -> str", &simd_level);
}
