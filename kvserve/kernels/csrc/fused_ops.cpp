// Fused element-wise ops of the decoder layer, one pass each instead of 5-10 torch ops:
// rms_norm, add_rms_norm (residual add then norm, in one pass), rotary_ (in place on q and k), silu_mul.
// At decode batch sizes each torch op costs more in dispatch than in arithmetic, so a layer's
// ~50 small ops were a fifth of a single-stream step. float32 and bfloat16 (computed in float).
//
// Each op is a loop over a range of rows (kvserve::rows, float32, for decode_stack.cpp, which
// splits rows across its own threads) wrapped by the registered op, which splits them with
// at::parallel_for.
#include "ops.h"
#include "vec.h"

#include <cmath>
#include <cstring>
#include <type_traits>

namespace kvserve {
namespace {

// Rows per thread chunk: below ~64k elements an op runs on one thread. Each parallel region costs a
// wake-up of every thread, and one whose core is taken (the server's API process on a 2-core machine)
// stalls the region; these ops take microseconds, so they only split when the work is large.
inline int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, row_elems)); }

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

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
void rms_norm(const float* x, const float* w, float* out, int64_t h, float eps, int64_t r0, int64_t r1) {
  norm_rows<float, float, float>(const_cast<float*>(x), nullptr, w, out, h, eps, r0, r1);  // no delta: x only read
}
void rotary(float* x, int64_t heads, int64_t d, int64_t row_stride, const int64_t* pos, const float* cos,
            const float* sin, int64_t r0, int64_t r1) {
  rotary_range<float>(x, heads, d, row_stride, pos, cos, sin, r0, r1);
}
void silu_mul(const float* gu, float* out, int64_t inter, int64_t r0, int64_t r1) {
  silu_mul_range<float>(gu, out, inter, r0, r1);
}
void silu_mul_bf16(const c10::BFloat16* gu, c10::BFloat16* out, int64_t inter, int64_t r0, int64_t r1) {
  silu_mul_range<c10::BFloat16>(gu, out, inter, r0, r1);
}
}  // namespace rows

namespace {
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

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, std::optional<at::ScalarType> out_dtype,
                    int64_t out_rows) {
  return norm_impl(const_cast<at::Tensor&>(x), nullptr, w, eps, out_dtype, out_rows);  // no delta: x is only read
}

// residual += delta (in place, one pass with the norm's sum of squares); returns rms_norm(residual)
at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& w, double eps,
                        std::optional<at::ScalarType> out_dtype, int64_t out_rows) {
  return norm_impl(residual, &delta, w, eps, out_dtype, out_rows);
}

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

// cache[slots[t]] = x[t] for each row t: the KV write of a step's new tokens. x's rows may be strided
// (k and v are views of the fused qkv output) but each row's [heads, d] is contiguous: one copy a row,
// rows split across threads. torch's index_copy_ took ~2% of an AMX prefill for these few bytes.
void store_rows_(at::Tensor& cache, const at::Tensor& slots, const at::Tensor& x) {
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous() && x.dim() == 3 && x.size(1) == cache.size(1) &&
                  x.size(2) == cache.size(2) && x.stride(2) == 1 && x.stride(1) == x.size(2) &&
                  x.scalar_type() == cache.scalar_type(),
              "store_rows_: cache [S, H, D] contiguous, x [T, H, D] of its dtype with contiguous rows");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() && slots.size(0) == x.size(0),
              "store_rows_: slots int64 [T]");
  const int64_t n = x.size(0), num_slots = cache.size(0), row_bytes = x.size(1) * x.size(2) * x.element_size();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "store_rows_: slot out of range");
  char* dst = static_cast<char*>(cache.data_ptr());
  const char* src = static_cast<const char*>(x.data_ptr());
  const int64_t src_stride = x.stride(0) * x.element_size();
  at::parallel_for(0, n, grain_rows(x.size(1) * x.size(2)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) std::memcpy(dst + sp[t] * row_bytes, src + t * src_stride, row_bytes);
  });
}

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

namespace {

// the largest of a row's n values (read as floats)
template <typename T>
float row_max(const T* row, int64_t n) {
  float best = to_f(row[0]);
  int64_t j = 0;
#if defined(__AVX2__) || defined(__AVX512F__)
  using namespace vec;
  if (n >= 4 * W) {
    vf m0 = vload(row), m1 = vload(row + W), m2 = vload(row + 2 * W), m3 = vload(row + 3 * W);
    for (j = 4 * W; j + 4 * W <= n; j += 4 * W) {
      m0 = vmax(m0, vload(row + j)), m1 = vmax(m1, vload(row + j + W));
      m2 = vmax(m2, vload(row + j + 2 * W)), m3 = vmax(m3, vload(row + j + 3 * W));
    }
    float lanes[W];
    vstore(lanes, vmax(vmax(m0, m1), vmax(m2, m3)));
    for (int l = 0; l < W; ++l) best = std::max(best, lanes[l]);
  }
#endif
  for (; j < n; ++j) best = std::max(best, to_f(row[j]));
  return best;
}

using vec::scaled_exp;
using vec::scaled_exp1;

// Logits as the LM head left them: float32, or bfloat16 where an AMX GEMM wrote them (read as the
// floats they are: the same token as after a conversion, without its pass over the rows).
void check_logits(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) > 0 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": float32 or bfloat16 [R, V] contiguous, V > 0");
}

// the first index of `row` holding v (n when none does), a vector of lanes compared at a time
template <typename T>
int64_t first_equal(const T* row, int64_t n, float v) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 b = _mm512_set1_ps(v);
  for (; j + 16 <= n; j += 16)
    if (const __mmask16 m = _mm512_cmp_ps_mask(vec::vload(row + j), b, _CMP_EQ_OQ)) return j + __builtin_ctz(m);
#elif defined(__AVX2__)
  const __m256 b = _mm256_set1_ps(v);
  for (; j + 8 <= n; j += 8)
    if (const int m = _mm256_movemask_ps(_mm256_cmp_ps(vec::vload(row + j), b, _CMP_EQ_OQ))) return j + __builtin_ctz(m);
#endif
  for (; j < n; ++j)
    if (to_f(row[j]) == v) return j;
  return n;
}

template <typename T>
void argmax_rows_impl(const T* xp, int64_t rows, int64_t n, int64_t* op) {
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = xp + r * n;
      const int64_t at = first_equal(row, n, row_max(row, n));
      op[r] = at < n ? at : 0;
    }
  });
}

template <typename T>
void sample_rows_impl(const T* xp, int64_t rows, int64_t n, const float* tp, const float* up, int64_t* op) {
  using namespace vec;
  const int64_t full = n / W, blocks = full + (n - full * W);  // then the tail, one element a block
  auto block_start = [&](int64_t b) { return b < full ? b * W : full * W + (b - full); };
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> sums(blocks);
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = xp + r * n;
      const float m = row_max(row, n), it = tp[r];
      const vf vm = vset1(-m), vt = vset1(it);
      double total = 0.0;
      for (int64_t b = 0; b < full; ++b) total += sums[b] = vsum(scaled_exp(vload(row + b * W), vm, vt));
      for (int64_t b = full; b < blocks; ++b) total += sums[b] = scaled_exp1(to_f(row[block_start(b)]), m, it);
      const double target = static_cast<double>(up[r]) * total;
      // the block where the running mass passes target, then the lane; rounding can leave the lanes
      // (or every block) a hair under target: then the last token of positive mass before it
      int64_t pick = -1, last_block = -1;
      double acc = 0.0;
      float lanes[W];
      for (int64_t b = 0; b < blocks; ++b) {
        if (!(sums[b] > 0.f)) continue;
        if (acc + sums[b] <= target) {
          acc += sums[b];
          last_block = b;
          continue;
        }
        const int64_t start = block_start(b), width = b < full ? W : 1;
        if (width == W) vstore(lanes, scaled_exp(vload(row + start), vm, vt));
        else lanes[0] = sums[b];
        int64_t last_lane = -1;
        for (int64_t l = 0; l < width; ++l) {
          if (!(lanes[l] > 0.f)) continue;
          last_lane = start + l;
          acc += lanes[l];
          if (acc > target) break;
        }
        pick = last_lane;
        break;
      }
      if (pick < 0 && last_block >= 0) {
        const int64_t start = block_start(last_block), width = last_block < full ? W : 1;
        if (width == W) vstore(lanes, scaled_exp(vload(row + start), vm, vt));
        else lanes[0] = sums[last_block];
        for (int64_t l = 0; l < width; ++l)
          if (lanes[l] > 0.f) pick = start + l;
      }
      if (pick < 0) {  // no mass at all (every logit -inf or NaN): the first max, as greedy would
        pick = 0;
        while (pick < n && !(to_f(row[pick]) == m)) ++pick;
        if (pick >= n) pick = 0;
      }
      op[r] = pick;
    }
  });
}

}  // namespace

// The first index of each row's largest value (torch.argmax's choice among ties), for greedy
// sampling: rows in parallel, a vector max then a vector scan for its first position (the scan was
// scalar: 0.67 ms of 64 rows of the 49k vocabulary here). torch's argmax ran
// 64 rows of the 49k vocabulary on one thread at ~2.7 GB/s (4.6 ms, a twentieth of the step).
// A row holding NaN gets some index in range (torch would give the NaN's).
at::Tensor argmax_rows(const at::Tensor& x) {
  check_logits(x, "argmax_rows");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat) argmax_rows_impl(x.data_ptr<float>(), x.size(0), x.size(1), out.data_ptr<int64_t>());
  else argmax_rows_impl(x.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), out.data_ptr<int64_t>());
  return out;
}

// One token per row drawn from softmax(x * inv_temp) by inverting its cumulative distribution: the
// first index whose running mass exceeds u * total, as torch's cumsum + searchsorted picks it (and a
// token of zero probability is never drawn). One pass finds the row's max, one sums the exps a
// vector at a time (kept per block); the draw then walks the block sums and recomputes one block.
// torch's softmax, cumsum and searchsorted made five passes over a 49k vocabulary (9 ms for 64 rows).
at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& inv_temp, const at::Tensor& u) {
  check_logits(x, "sample_rows");
  const int64_t rows = x.size(0), n = x.size(1);
  for (const at::Tensor* t : {&inv_temp, &u})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->is_contiguous() && t->scalar_type() == at::kFloat,
                "sample_rows: inv_temp and u are float32 [R]");
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float *tp = inv_temp.data_ptr<float>(), *up = u.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) sample_rows_impl(x.data_ptr<float>(), rows, n, tp, up, out.data_ptr<int64_t>());
  else sample_rows_impl(x.data_ptr<c10::BFloat16>(), rows, n, tp, up, out.data_ptr<int64_t>());
  return out;
}
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("argmax_rows(Tensor x) -> Tensor", &kvserve::argmax_rows);
  m.def("sample_rows(Tensor x, Tensor inv_temp, Tensor u) -> Tensor", &kvserve::sample_rows);
  m.def("rms_norm(Tensor x, Tensor w, float eps, ScalarType? out_dtype=None, int out_rows=0) -> Tensor",
        &kvserve::rms_norm);
  m.def("add_rms_norm(Tensor(a!) residual, Tensor delta, Tensor w, float eps, ScalarType? out_dtype=None, "
        "int out_rows=0) -> Tensor", &kvserve::add_rms_norm);
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()", &kvserve::rotary_);
  m.def("silu_mul(Tensor gu) -> Tensor", &kvserve::silu_mul);
  m.def("store_rows_(Tensor(a!) cache, Tensor slots, Tensor x) -> ()", &kvserve::store_rows_);
}
