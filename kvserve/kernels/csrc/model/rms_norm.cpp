// kvserve::rms_norm and add_rms_norm (residual add then norm, in one pass), float32 or bfloat16
// (computed in float): one pass over each row instead of 5-10 torch ops. At decode batch sizes each
// torch op costs more in dispatch than in arithmetic, so a layer's ~50 small ops were a fifth of a
// single-stream step. rows::rms_norm is the same loop over a range of float32 rows, for
// decode_step.cpp, which splits rows across its own threads.
#include "common/ops.h"
#include "common/rows.h"
#include "common/vec.h"

#include <cmath>
#include <type_traits>

namespace kvserve {
namespace {

using rowops::grain_rows;
using rowops::to_f;

// residual[r] += delta[r] where a delta is given (stored as R), then out[r] = w * (residual[r] / rms)
// with the normalisation in float and cast to R before the scale (the order Hugging Face's
// LlamaRMSNorm uses), stored as O: R, or bf16 where a bf16 GEMM reads it next (the cast its input
// would otherwise get, in the same pass). D: the delta's type (R, or bf16 from a bf16 GEMM).
template <typename R, typename D, typename O>
void norm_rows(R* x, const D* delta, const R* w, O* out, int64_t h, float eps, int64_t r0, int64_t r1) {
  using namespace vec;
  constexpr bool r_bf16 = std::is_same_v<R, BF16>;
  for (int64_t r = r0; r < r1; ++r) {
    R* xr = x + r * h;
    const D* dr = delta != nullptr ? delta + r * h : nullptr;
    O* orow = out + r * h;
    vf acc = vzero();
    int64_t j = 0;
    for (; j + W <= h; j += W) {
      vf v = vload(xr + j);
      if (dr != nullptr) {
        v = vadd(v, vload(dr + j));
        if constexpr (r_bf16) v = vround_bf16(v);
        vstore(xr + j, v);
      }
      acc = vfma(v, v, acc);
    }
    float ss = vsum(acc);
    for (; j < h; ++j) {
      if (dr != nullptr) xr[j] = static_cast<R>(to_f(xr[j]) + to_f(dr[j]));
      ss += to_f(xr[j]) * to_f(xr[j]);
    }
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
    const vf vinv = vset1(inv);
    for (j = 0; j + W <= h; j += W) {
      vf y = vmul(vload(xr + j), vinv);
      if constexpr (r_bf16) y = vround_bf16(y);
      y = vmul(vload(w + j), y);
      if constexpr (r_bf16 && !std::is_same_v<O, BF16>) y = vround_bf16(y);
      vstore(orow + j, y);
    }
    for (; j < h; ++j) orow[j] = static_cast<O>(static_cast<R>(to_f(w[j]) * to_f(static_cast<R>(to_f(xr[j]) * inv))));
  }
}

template <typename R, typename D, typename O>
void norm_rows_parallel(const at::Tensor& x, const at::Tensor* delta, const at::Tensor& w, at::Tensor& out, double eps) {
  const int64_t h = x.size(1);
  R* xp = static_cast<R*>(x.data_ptr());
  const D* dp = delta != nullptr ? static_cast<const D*>(delta->data_ptr()) : nullptr;
  at::parallel_for(0, x.size(0), grain_rows(h), [&](int64_t r0, int64_t r1) {
    norm_rows<R, D, O>(xp, dp, static_cast<const R*>(w.data_ptr()), static_cast<O*>(out.data_ptr()), h,
                       static_cast<float>(eps), r0, r1);
  });
}

// residual (float32 or bf16) += delta (its dtype, or bf16 on a float32 residual) when given; returns
// the norm as out_dtype (default: the residual's; bf16 allowed on a float32 residual), out_rows rows
// if more than the residual's (zeros past them)
at::Tensor norm_impl(at::Tensor& x, const at::Tensor* delta, const at::Tensor& w, double eps,
                     std::optional<at::ScalarType> out_dtype, int64_t out_rows) {
  const auto rt = x.scalar_type(), ot = out_dtype.value_or(rt);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.dim() == 1 && x.size(1) == w.size(0) &&
                  w.scalar_type() == rt, "rms_norm: x [T, H] contiguous, w [H] of x's dtype");
  TORCH_CHECK(rt == at::kFloat || rt == at::kBFloat16, "rms_norm: float32 or bfloat16");
  TORCH_CHECK(ot == rt || ot == at::kBFloat16, "rms_norm: out_dtype is x's or bfloat16");
  const auto dt = delta != nullptr ? delta->scalar_type() : rt;
  TORCH_CHECK(delta == nullptr || (delta->is_contiguous() && delta->sizes() == x.sizes() && (dt == rt || dt == at::kBFloat16)),
              "add_rms_norm: delta is contiguous, of the residual's shape, its dtype or bfloat16");
  // out_rows > T: the output has that many rows, those past T zeros (a GEMM's padded input, no copy)
  const int64_t t = x.size(0);
  auto out = at::empty({std::max(out_rows, t), x.size(1)}, x.options().dtype(ot));
  if (out.size(0) > t) out.narrow(0, t, out.size(0) - t).zero_();
  using F = float;
  using BF16 = vec::BF16;
  if (rt == at::kBFloat16) norm_rows_parallel<BF16, BF16, BF16>(x, delta, w, out, eps);
  else if (dt == at::kBFloat16 && ot == at::kBFloat16) norm_rows_parallel<F, BF16, BF16>(x, delta, w, out, eps);
  else if (dt == at::kBFloat16) norm_rows_parallel<F, BF16, F>(x, delta, w, out, eps);
  else if (ot == at::kBFloat16) norm_rows_parallel<F, F, BF16>(x, delta, w, out, eps);
  else norm_rows_parallel<F, F, F>(x, delta, w, out, eps);
  return out;
}

}  // namespace

namespace rows {
void rms_norm(const float* x, const float* w, float* out, int64_t h, float eps, int64_t r0, int64_t r1) {
  norm_rows<float, float, float>(const_cast<float*>(x), nullptr, w, out, h, eps, r0, r1);  // no delta: x only read
}
}  // namespace rows

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, std::optional<at::ScalarType> out_dtype,
                    int64_t out_rows) {
  return norm_impl(const_cast<at::Tensor&>(x), nullptr, w, eps, out_dtype, out_rows);  // no delta: x is only read
}

// residual += delta (in place, one pass with the norm's sum of squares); returns rms_norm(residual)
at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& w, double eps,
                        std::optional<at::ScalarType> out_dtype, int64_t out_rows) {
  return norm_impl(residual, &delta, w, eps, out_dtype, out_rows);
}

}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, ScalarType? out_dtype=None, int out_rows=0) -> Tensor",
        &kvserve::rms_norm);
  m.def("add_rms_norm(Tensor(a!) residual, Tensor delta, Tensor w, float eps, ScalarType? out_dtype=None, "
        "int out_rows=0) -> Tensor", &kvserve::add_rms_norm);
}
