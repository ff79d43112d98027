// kvserve::rotary_: the rotary position embedding of q and k, in place (rotate-half convention),
// float32 or bfloat16 rows (computed in float); rows::rotary is the same loop over a range of float32
// rows, for decode_step.cpp.
#include "common/ops.h"
#include "common/rows.h"
#include "common/vec.h"

#include <type_traits>

namespace kvserve {
namespace {

using rowops::grain_rows;
using rowops::to_f;

// x: rows of [heads, d] (a contiguous last dim), rotate-half convention, positions index the tables
template <typename T>
void rotary_range(T* x, int64_t heads, int64_t d, int64_t row_stride, const int64_t* pos, const float* cos,
                  const float* sin, int64_t t0, int64_t t1) {
  const int64_t half = d / 2;
  for (int64_t i = t0; i < t1; ++i) {
    const float* c = cos + pos[i] * d;
    const float* s = sin + pos[i] * d;
    for (int64_t hh = 0; hh < heads; ++hh) {
      T* v = x + i * row_stride + hh * d;
#if defined(__AVX2__) || defined(__AVX512F__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {  // an AMX prefill's q/k: the compiler left this loop scalar
        using namespace vec;
        if (half % W == 0) {
          for (int64_t j = 0; j < half; j += W) {
            const vf a = vload(v + j), b = vload(v + j + half);
            vstore(v + j, vsub(vmul(a, vload(c + j)), vmul(b, vload(s + j))));
            vstore(v + j + half, vadd(vmul(b, vload(c + j + half)), vmul(a, vload(s + j + half))));
          }
          continue;
        }
      }
#endif
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        const float a = to_f(v[j]), b = to_f(v[j + half]);
        v[j] = static_cast<T>(a * c[j] - b * s[j]);
        v[j + half] = static_cast<T>(b * c[j + half] + a * s[j + half]);
      }
    }
  }
}

}  // namespace

namespace rows {
void rotary(float* x, int64_t heads, int64_t d, int64_t row_stride, const int64_t* pos, const float* cos,
            const float* sin, int64_t r0, int64_t r1) {
  rotary_range<float>(x, heads, d, row_stride, pos, cos, sin, r0, r1);
}
}  // namespace rows

// q: [T, heads, d], k: [T, kv_heads, d], rotated in place; cos, sin: float32 [max_pos, d]
void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous(), "rotary_: cos/sin must be contiguous float32");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "rotary_: positions must be int64");
  for (at::Tensor* x : {&q, &k}) {
    TORCH_CHECK(x->dim() == 3 && x->stride(2) == 1 && x->stride(1) == x->size(2), "rotary_: [T, heads, d] rows");
    const int64_t heads = x->size(1), d = x->size(2);
    AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, x->scalar_type(), "rotary_", [&] {
      at::parallel_for(0, x->size(0), grain_rows(heads * d), [&](int64_t t0, int64_t t1) {
        rotary_range<scalar_t>(x->data_ptr<scalar_t>(), heads, d, x->stride(0), positions.data_ptr<int64_t>(),
                               cos.data_ptr<float>(), sin.data_ptr<float>(), t0, t1);
      });
    });
  }
}

}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()", &kvserve::rotary_);
}
