// kvserve::read_stream(bytes) -> int: reads every byte of a tensor once, on torch's threads, each a
// contiguous share with the decode kernels' prefetch, and returns a checksum (so nothing is elided).
// `kvserve bench roofline` times it for the memory's read bandwidth: the ceiling that the weight
// stream of a decode step meets, read the way those kernels read.
#include "common/common.h"
#include "common/prefetch.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvserve {
namespace {

uint64_t xor_range(const uint8_t* p, int64_t n) {
  StreamPrefetch pf(p);
  int64_t i = 0;
  uint64_t out = 0;
#if defined(__AVX2__)
  __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
  for (; i + 64 <= n; i += 64) {
    pf.upto(p + i + 64);
    a = _mm256_xor_si256(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    b = _mm256_xor_si256(b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_xor_si256(a, b));
  out = lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
#endif
  for (; i + 8 <= n; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, 8);
    out ^= v;
  }
  for (; i < n; ++i) out ^= p[i];
  return out;
}

int64_t read_stream(const at::Tensor& bytes) {
  TORCH_CHECK(bytes.device().is_cpu() && bytes.is_contiguous(), "read_stream: a contiguous CPU tensor");
  const uint8_t* p = static_cast<const uint8_t*>(bytes.data_ptr());
  const int64_t n = bytes.numel() * bytes.element_size();
  std::atomic<uint64_t> sum{0};
  constexpr int64_t kGrain = int64_t{1} << 20;  // 1 MB: every thread gets a long stream
  at::parallel_for(0, (n + kGrain - 1) / kGrain, 1, [&](int64_t c0, int64_t c1) {
    const int64_t b0 = c0 * kGrain, b1 = std::min(n, c1 * kGrain);
    sum.fetch_xor(xor_range(p + b0, b1 - b0));
  });
  return static_cast<int64_t>(sum.load());
}

}  // namespace
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) { m.def("read_stream(Tensor bytes) -> int", &kvserve::read_stream); }
