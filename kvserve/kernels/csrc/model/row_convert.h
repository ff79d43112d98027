// Row conversions of the decode stack (decode_step.cpp): float32 rows to and from bf16 (a bf16
// cache's new rows, the inputs and outputs of bf16 GEMMs), and new K/V rows into an 8-bit cache.
#pragma once
#include "common/common.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace kvserve {
namespace convert {

// New K or V rows into an 8-bit cache, as QuantizedKVPool.quantize does it: x * (1 / scale),
// saturated at +-qmax, rounded to nearest even (int8) or converted (fp8 rounds to nearest itself).
template <typename T>
void quantize_rows(const float* src, int64_t src_stride, T* dst, const int64_t* slots, const float* inv_scale,
                   int64_t n, int64_t r0, int64_t r1) {
  const float qmax = std::is_same_v<T, int8_t> ? 127.f : static_cast<float>(std::numeric_limits<T>::max());
  for (int64_t t = r0; t < r1; ++t) {
    const float* x = src + t * src_stride;
    T* out = dst + slots[t] * n;
    for (int64_t i = 0; i < n; ++i) {
      const float y = std::min(std::max(x[i] * inv_scale[i], -qmax), qmax);
      if constexpr (std::is_same_v<T, int8_t>) out[i] = static_cast<int8_t>(std::nearbyint(y));
      else out[i] = T(y);
    }
  }
}

using QuantizeRows = void (*)(const float*, int64_t, void*, const int64_t*, const float*, int64_t, int64_t, int64_t);

template <typename T>
void quantize_rows_erased(const float* src, int64_t src_stride, void* dst, const int64_t* slots, const float* inv_scale,
                          int64_t n, int64_t r0, int64_t r1) {
  quantize_rows<T>(src, src_stride, static_cast<T*>(dst), slots, inv_scale, n, r0, r1);
}

inline QuantizeRows quantizer_for(at::ScalarType s) {
  if (s == at::kChar) return &quantize_rows_erased<int8_t>;
  if (s == at::kFloat8_e4m3fn) return &quantize_rows_erased<c10::Float8_e4m3fn>;
  return &quantize_rows_erased<c10::Float8_e5m2>;
}

// Round to nearest even, as c10::BFloat16(float) does for finite values, in integer ops the compiler
// vectorizes (activations are finite: no NaN case).
inline void rows_to_bf16(const float* x, c10::BFloat16* y, int64_t n, int64_t r0, int64_t r1) {
  const uint32_t* in = reinterpret_cast<const uint32_t*>(x);
  uint16_t* out = reinterpret_cast<uint16_t*>(y);
  for (int64_t i = r0 * n; i < r1 * n; ++i) out[i] = static_cast<uint16_t>((in[i] + 0x7fffu + ((in[i] >> 16) & 1u)) >> 16);
}

inline void rows_from_bf16(const c10::BFloat16* x, float* y, int64_t n, int64_t r0, int64_t r1) {
  const uint16_t* in = reinterpret_cast<const uint16_t*>(x);
  uint32_t* out = reinterpret_cast<uint32_t*>(y);
  for (int64_t i = r0 * n; i < r1 * n; ++i) out[i] = static_cast<uint32_t>(in[i]) << 16;
}

}  // namespace convert
}  // namespace kvserve
