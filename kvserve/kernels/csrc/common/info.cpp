// What this build compiled for: kvserve::simd_level() -> "avx512" | "avx2" | "scalar", the vector
// path the compiler's own macros chose; kvserve::isa() -> the instruction set the build was asked
// for (-DKVSERVE_ISA="avx2", ...), or "native" for one made for the CPU it runs on (-march=native).
#include "common/common.h"

#include <string>

namespace {

std::string simd_level() { return KVSERVE_SIMD; }

#ifdef KVSERVE_ISA
std::string isa() { return KVSERVE_ISA; }
#else
std::string isa() { return "native"; }
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("simd_level() -> str", &simd_level);
  m.def("isa() -> str", &isa);
}
