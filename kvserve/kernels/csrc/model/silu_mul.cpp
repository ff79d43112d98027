// kvserve::silu_mul: an MLP's silu(gate) * up from the fused gate/up projection's rows, float32 or
// bfloat16; rows::silu_mul and rows::silu_mul_bf16 are the same loop over a range of rows, for
// decode_step.cpp.
#include "common/ops.h"
#include "common/rows.h"
#include "common/vec.h"

#include <cmath>
#include <type_traits>

namespace kvserve {
namespace {

using rowops::grain_rows;
using rowops::to_f;

// silu(gate) * up per row of gu = [gate | up], silu rounded to T before the product, as torch does
template <typename T>
void silu_mul_range(const T* src, T* dst, int64_t inter, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = src + r * 2 * inter;
    const T* u = g + inter;
    T* o = dst + r * inter;
    int64_t j = 0;
#if defined(__AVX2__) || defined(__AVX512F__)
    using namespace vec;
    const vf one = vset1(1.f), minus_one = vset1(-1.f);
    if constexpr (std::is_same_v<T, float>) {
      for (; j + W <= inter; j += W) {
        const vf a = vload(g + j);
        vstore(o + j, vmul(vdiv(a, vadd(one, vexp(vmul(a, minus_one)))), vload(u + j)));
      }
    } else if constexpr (std::is_same_v<T, BF16>) {  // bf16 in and out (an AMX step's MLP)
      // a / b as a x (1 / b) by the reciprocal estimate and one Newton step (~2^-23 relative): the
      // division's throughput bounded the loop, and silu is rounded to bf16 right after
      const vf two = vset1(2.f);
      for (; j + W <= inter; j += W) {
        const vf a = vload(g + j), b = vadd(one, vexp_for_bf16(vmul(a, minus_one)));
        vf r = vrcp(b);
        r = vmul(r, vfma(vmul(b, r), minus_one, two));
        vstore(o + j, vmul(vround_bf16(vmul(a, r)), vload(u + j)));
      }
    }
#endif
    for (; j < inter; ++j) {
      const float a = to_f(g[j]);
      o[j] = static_cast<T>(to_f(static_cast<T>(a / (1.0f + std::exp(-a)))) * to_f(u[j]));
    }
  }
}

}  // namespace

namespace rows {
void silu_mul(const float* gu, float* out, int64_t inter, int64_t r0, int64_t r1) {
  silu_mul_range<float>(gu, out, inter, r0, r1);
}
void silu_mul_bf16(const c10::BFloat16* gu, c10::BFloat16* out, int64_t inter, int64_t r0, int64_t r1) {
  silu_mul_range<c10::BFloat16>(gu, out, inter, r0, r1);
}
}  // namespace rows

// gu: [T, 2I] (gate then up) -> silu(gate) * up: [T, I]
at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0, "silu_mul: [T, 2I] contiguous");
  const int64_t t = gu.size(0), inter = gu.size(1) / 2;
  auto out = at::empty({t, inter}, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, gu.scalar_type(), "silu_mul", [&] {
    at::parallel_for(0, t, grain_rows(2 * inter), [&](int64_t r0, int64_t r1) {
      silu_mul_range<scalar_t>(gu.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), inter, r0, r1);
    });
  });
  return out;
}

}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("silu_mul(Tensor gu) -> Tensor", &kvserve::silu_mul);
}
