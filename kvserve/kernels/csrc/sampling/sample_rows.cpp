// The samplers' picks over rows of logits: kvserve::argmax_rows (greedy) and kvserve::sample_rows
// (a plain-temperature draw), a vector pass or two over each row instead of torch's several.
#include "common/ops.h"
#include "common/rows.h"
#include "common/vec.h"

#include <vector>

namespace kvserve {
namespace {

using rowops::to_f;

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
}
