// kvserve::zeros_huge(bytes): a zeroed byte tensor whose whole 2 MB extents are backed by huge pages
// (madvise before the first touch, on Linux; elsewhere, and where the kernel says no, plain pages).
// The packed quantized weights live here: a decode step streams every byte of them once, and on
// 4 KB pages that is a TLB miss every 4 KB, which the hardware prefetch does not cross.
#include "common/common.h"
#include "common/ops.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kvserve {

at::Tensor zeros_huge(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "zeros_huge: bytes must be >= 0");
  at::Tensor t = at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{1} << 21;
  const uintptr_t p = reinterpret_cast<uintptr_t>(t.data_ptr()), a = (p + kHuge - 1) & ~(kHuge - 1),
                  e = (p + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  if (e > a) madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE);  // advice: a refusal changes nothing
#endif
  t.zero_();
  return t;
}

}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) { m.def("zeros_huge(int bytes) -> Tensor", &kvserve::zeros_huge); }
