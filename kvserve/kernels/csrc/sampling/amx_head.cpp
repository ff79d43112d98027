// The LM head and the draw of a decode step in one pass, on AMX tiles: for each row, the token that
// greedy decoding (inv_temp 0) or plain-temperature sampling (softmax(logits * inv_temp), one U[0, 1)
// number u per row) picks, without writing the logits. The sampler's path writes [rows, vocab]
// logits (6 MB in bf16 for 64 rows of a 49k vocabulary) and reads them back once or twice; here
// each 32 x 32 block of sums (amx_panels.h) is reduced while it is in L1:
//   - per row and panel: the largest logit, and for a greedy row its first column, for a sampled row
//     the mass sum(exp((logit - panel max) * inv_temp)) of the panel's 32;
//   - then per row: greedy takes the first panel holding the row's largest logit; sampling weighs
//     each panel's mass by exp((panel max - row max) * inv_temp), finds the panel where the running
//     mass passes u * total, recomputes that panel's 32 logits (row_products: the same bits) and
//     walks them.
// The logits are rounded to bf16 first, as the LM head's bf16 output would be, so the picks are those
// of sampler.py's native draws over amx_linear's logits: greedy the same token, sampling the same up
// to float rounding where u * total falls on a boundary (the mass is summed in another grouping).
#include "gemm/amx_panels.h"
#include "common/ops.h"
#include "common/vec.h"

#include <cmath>
#include <limits>
#include <memory>

namespace kvserve {
using namespace panels;
namespace {

#if defined(KVSERVE_AMX_TILES)
using vec::vf;
using vec::scaled_exp;  // the softmax term, as sample_rows.cpp's draw computes it

// What the first pass keeps per row and panel ([M, P], row-major)
struct PanelStats {
  float* max;      // the panel's largest (bf16-rounded) logit
  float* mass;     // sampled rows: sum(exp((logit - max) * inv_temp)) over the panel
  uint8_t* first;  // greedy rows: the first column holding max
  int64_t P;
};

// a row's 32 sums as bf16-rounded floats; columns past the vocabulary -inf
inline void load_row(const float* c, int64_t cols, vf& lo, vf& hi) {
  const vf ninf = vec::vset1(-std::numeric_limits<float>::infinity());
  lo = vec::vround_bf16(_mm512_load_ps(c));
  hi = vec::vround_bf16(_mm512_load_ps(c + 16));
  if (cols < 32) {
    const __mmask32 keep = (__mmask32{1} << cols) - 1;
    lo = _mm512_mask_blend_ps(static_cast<__mmask16>(keep), ninf, lo);
    hi = _mm512_mask_blend_ps(static_cast<__mmask16>(keep >> 16), ninf, hi);
  }
}

// Rows [i0, i0 + 16) of a block (those under `rows`): each row's largest logit, and for greedy rows
// its first column, for sampled rows the panel's mass. The 16 rows' maxima and masses are reduced
// together (vec::reduce16_by), not one row at a time.
void reduce_rows16(const Gemm& g, const float* inv_t, PanelStats& st, const Block& blk, int64_t i0, int64_t rows) {
  using namespace vec;
  const int64_t cols = blk.cols(g), n = std::min<int64_t>(16, rows - i0);
  vf lo[16], hi[16], part[16];
  bool any_greedy = false, any_sampled = false;
  for (int64_t i = 0; i < 16; ++i) {
    if (i < n) {
      load_row(blk.c + (i0 + i) * 32, cols, lo[i], hi[i]);
      (inv_t[blk.r + i0 + i] == 0.f ? any_greedy : any_sampled) = true;
    } else {
      lo[i] = hi[i] = vzero();
    }
    part[i] = vmax(lo[i], hi[i]);
  }
  alignas(64) float m[16];
  vstore(m, reduce16_max(part));
  for (int64_t i = 0; i < n; ++i) st.max[(blk.r + i0 + i) * st.P + blk.p] = m[i];
  if (any_greedy)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = blk.r + i0 + i;
      if (inv_t[r] != 0.f) continue;
      const vf vm = vset1(m[i]);
      const uint32_t eq = _mm512_cmp_ps_mask(lo[i], vm, _CMP_EQ_OQ) | (uint32_t{_mm512_cmp_ps_mask(hi[i], vm, _CMP_EQ_OQ)} << 16);
      st.first[r * st.P + blk.p] = static_cast<uint8_t>(eq == 0 ? 0 : __builtin_ctz(eq));
    }
  if (!any_sampled) return;
  for (int64_t i = 0; i < 16; ++i) {
    const vf neg_m = vset1(-m[i]), it = vset1(i < n ? inv_t[blk.r + i0 + i] : 0.f);
    part[i] = vadd(scaled_exp(lo[i], neg_m, it), scaled_exp(hi[i], neg_m, it));
  }
  alignas(64) float mass[16];
  vstore(mass, reduce16(part));
  for (int64_t i = 0; i < n; ++i) st.mass[(blk.r + i0 + i) * st.P + blk.p] = mass[i];
}

void reduce_block(const Gemm& g, const float* inv_t, PanelStats& st, const Block& blk) {
  const int64_t rows = blk.rows(g);
  for (int64_t i0 = 0; i0 < rows; i0 += 16) reduce_rows16(g, inv_t, st, blk, i0, rows);
}

// the first panel holding the row's largest logit, and its column there (0 when none compares)
int64_t greedy_pick(const PanelStats& st, int64_t r) {
  const float* mx = st.max + r * st.P;
  float best = -std::numeric_limits<float>::infinity();
  int64_t pick = 0;
  for (int64_t p = 0; p < st.P; ++p)
    if (mx[p] > best) best = mx[p], pick = p * kPanel + st.first[r * st.P + p];
  return pick;
}

// Row r's draw: the first column whose running mass passes u * total, the panels' masses summed as
// sampler.py's native draw sums its blocks (in double). Rounding can leave a panel's lanes (or every
// panel) a hair under the target: then the last column of positive mass before it.
int64_t sample_pick(const Gemm& g, const PanelStats& st, int64_t r, float inv_t, float u, std::vector<float>& w) {
  const int64_t P = st.P;
  const float* mx = st.max + r * P;
  const float* mass = st.mass + r * P;
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < P; ++p) m = std::max(m, mx[p]);
  if (!std::isfinite(m)) return 0;
  // each panel's mass against the row's max, 16 panels at a time
  w.resize(P);
  const vf neg_m = vec::vset1(-m), it = vec::vset1(inv_t);
  int64_t p = 0;
  for (; p + 16 <= P; p += 16)
    vec::vstore(w.data() + p, vec::vmul(_mm512_loadu_ps(mass + p), scaled_exp(_mm512_loadu_ps(mx + p), neg_m, it)));
  for (; p < P; ++p) w[p] = mass[p] * vec::scaled_exp1(mx[p], m, inv_t);
  double total = 0.0;
  for (p = 0; p < P; ++p) total += w[p];
  if (!(total > 0.0)) return greedy_pick(st, r);  // unreachable for finite logits: the max's panel has mass >= 1
  const double target = static_cast<double>(u) * total;
  double acc = 0.0;
  int64_t chosen = -1, last = -1;
  for (p = 0; p < P; ++p) {
    if (!(w[p] > 0.f)) continue;
    if (acc + w[p] <= target) {
      acc += w[p];
      last = p;
      continue;
    }
    chosen = p;
    break;
  }
  const int64_t at = chosen >= 0 ? chosen : last;
  alignas(64) float c[16 * 32];
  row_products(g, g.x + r * g.K, at, c);
  vf lo, hi;
  load_row(c, std::min(kPanel, g.N - at * kPanel), lo, hi);
  alignas(64) float lanes[32];
  vec::vstore(lanes, scaled_exp(lo, neg_m, it));
  vec::vstore(lanes + 16, scaled_exp(hi, neg_m, it));
  int64_t pick = -1;
  for (int l = 0; l < 32; ++l) {
    if (!(lanes[l] > 0.f)) continue;
    pick = at * kPanel + l;
    if (chosen < 0) continue;  // no panel passed the target: the last positive lane of the last panel
    acc += lanes[l];
    if (acc > target) break;
  }
  return pick >= 0 ? pick : greedy_pick(st, r);
}
#endif

}  // namespace

at::Tensor amx_head_sample(const at::Tensor& x, const at::Tensor& packed, int64_t n, const at::Tensor& inv_temp,
                           const at::Tensor& u) {
  TORCH_CHECK(amx_gemm_available(), "amx_head_sample: this build or CPU has no AMX-BF16 tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "amx_head_sample: x must be a 2-D bfloat16 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), P = num_panels(n);
  TORCH_CHECK(n > 0 && holds_panels(packed, n, K),
              "amx_head_sample: packed does not hold an amx_pack'ed [", n, ", ", K, "] weight");
  for (const at::Tensor* t : {&inv_temp, &u})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == M,
                "amx_head_sample: inv_temp and u must be float32 [", M, "]");
  at::Tensor out = at::zeros({M}, x.options().dtype(at::kLong));
#if defined(KVSERVE_AMX_TILES)
  if (M == 0) return out;
  const at::Tensor xc = x.contiguous();
  const Gemm g{xc.data_ptr<BF16>(), packed.data_ptr<BF16>(), M, n, K};
  const float* it = inv_temp.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  // left uninitialized: every row's maxima are written, and a row's masses or first columns as it needs
  std::unique_ptr<float[]> maxes(new float[M * P]), mass(new float[M * P]);
  std::unique_ptr<uint8_t[]> first(new uint8_t[M * P]);
  PanelStats st{maxes.get(), mass.get(), first.get(), P};
  for_each_block(g, [&](const Block& blk) { reduce_block(g, it, st, blk); });
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
    amx::configure();
    std::vector<float> w;
    for (int64_t r = r0; r < r1; ++r) op[r] = it[r] == 0.f ? greedy_pick(st, r) : sample_pick(g, st, r, it[r], up[r], w);
    amx::release();
  });
#endif
  return out;
}

}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("amx_head_sample(Tensor x, Tensor packed, int n, Tensor inv_temp, Tensor u) -> Tensor", &kvserve::amx_head_sample);
}
