// kvserve::silu_mul and gelu_tanh_mul: a gated MLP's act(gate) * up from the fused gate/up
// projection's rows, float32 or bfloat16. Both activations are x * sigmoid(z(x)): SiLU with z = x,
// GELU-tanh with z = 2 sqrt(2/pi) (x + 0.044715 x^3) (0.5 (1 + tanh(y)) = sigmoid(2y)), so one loop
// serves both and GELU-tanh never subtracts tanh from 1. rows::silu_mul, rows::gelu_tanh_mul and
// their bf16 forms are the same loop over a range of rows, for decode_step.cpp.
#include "common/ops.h"
#include "common/rows.h"
#include "common/vec.h"

#include <cmath>
#include <type_traits>

namespace kvserve {
namespace {

using rowops::grain_rows;
using rowops::to_f;

// the sigmoid's argument z(x) of each activation, in vectors and in scalars
struct Silu {
#if defined(__AVX2__) || defined(__AVX512F__)
  static vec::vf z(vec::vf a) { return a; }
#endif
  static float z(float a) { return a; }
};

constexpr float kGeluK0 = 1.5957691216057308f;  // 2 sqrt(2 / pi)
constexpr float kGeluK1 = kGeluK0 * 0.044715f;

struct GeluTanh {
#if defined(__AVX2__) || defined(__AVX512F__)
  static vec::vf z(vec::vf a) {
    using namespace vec;
    return vmul(a, vfma(vmul(a, a), vset1(kGeluK1), vset1(kGeluK0)));
  }
#endif
  static float z(float a) { return a * (kGeluK0 + kGeluK1 * a * a); }
};

// act(gate) * up per row of gu = [gate | up], act rounded to T before the product, as torch does
template <typename Act, typename T>
void gated_mul_range(const T* src, T* dst, int64_t inter, int64_t r0, int64_t r1) {
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
        vstore(o + j, vmul(vdiv(a, vadd(one, vexp(vmul(Act::z(a), minus_one)))), vload(u + j)));
      }
    } else if constexpr (std::is_same_v<T, BF16>) {  // bf16 in and out (an AMX step's MLP)
      // a / b as a x (1 / b) by the reciprocal estimate and one Newton step (~2^-23 relative): the
      // division's throughput bounded the loop, and the activation is rounded to bf16 right after
      const vf two = vset1(2.f);
      for (; j + W <= inter; j += W) {
        const vf a = vload(g + j), b = vadd(one, vexp_for_bf16(vmul(Act::z(a), minus_one)));
        vf r = vrcp(b);
        r = vmul(r, vfma(vmul(b, r), minus_one, two));
        vstore(o + j, vmul(vround_bf16(vmul(a, r)), vload(u + j)));
      }
    }
#endif
    for (; j < inter; ++j) {
      const float a = to_f(g[j]);
      o[j] = static_cast<T>(to_f(static_cast<T>(a / (1.0f + std::exp(-Act::z(a))))) * to_f(u[j]));
    }
  }
}

// gu: [T, 2I] (gate then up) -> act(gate) * up: [T, I]
template <typename Act>
at::Tensor gated_mul(const at::Tensor& gu, const char* name) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0, name, ": [T, 2I] contiguous");
  const int64_t t = gu.size(0), inter = gu.size(1) / 2;
  auto out = at::empty({t, inter}, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, gu.scalar_type(), "gated_mul", [&] {
    at::parallel_for(0, t, grain_rows(2 * inter), [&](int64_t r0, int64_t r1) {
      gated_mul_range<Act, scalar_t>(gu.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), inter, r0, r1);
    });
  });
  return out;
}

}  // namespace

namespace rows {
void silu_mul(const float* gu, float* out, int64_t inter, int64_t r0, int64_t r1) {
  gated_mul_range<Silu, float>(gu, out, inter, r0, r1);
}
void silu_mul_bf16(const c10::BFloat16* gu, c10::BFloat16* out, int64_t inter, int64_t r0, int64_t r1) {
  gated_mul_range<Silu, c10::BFloat16>(gu, out, inter, r0, r1);
}
void gelu_tanh_mul(const float* gu, float* out, int64_t inter, int64_t r0, int64_t r1) {
  gated_mul_range<GeluTanh, float>(gu, out, inter, r0, r1);
}
void gelu_tanh_mul_bf16(const c10::BFloat16* gu, c10::BFloat16* out, int64_t inter, int64_t r0, int64_t r1) {
  gated_mul_range<GeluTanh, c10::BFloat16>(gu, out, inter, r0, r1);
}
}  // namespace rows

at::Tensor silu_mul(const at::Tensor& gu) { return gated_mul<Silu>(gu, "silu_mul"); }
at::Tensor gelu_tanh_mul(const at::Tensor& gu) { return gated_mul<GeluTanh>(gu, "gelu_tanh_mul"); }

}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("silu_mul(Tensor gu) -> Tensor", &kvserve::silu_mul);
  m.def("gelu_tanh_mul(Tensor gu) -> Tensor", &kvserve::gelu_tanh_mul);
}
