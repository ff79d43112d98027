// The paged attention kernel's inner loops over float rows (paged_items.cpp): q . k for a block's
// keys, p . v into a row's accumulators, and a row's streaming softmax. A non-float32 cache's rows are
// widened to float32 first (widen_rows); a bf16 cache on AVX512-BF16 takes bf16_dot.h's instead.
#pragma once
#include "common/vec.h"

#include <cmath>
#include <cstdint>
#include <limits>

namespace kvserve {
namespace paged {

using namespace kvserve::vec;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
inline float to_f32(T x) { return static_cast<float>(x); }

// a . b over d floats
template <int DS, typename T>
inline float dot(const float* a, const T* b, int d_rt) {
  const int d = DS > 0 ? DS : d_rt;
  vf s0 = vzero(), s1 = vzero();
  int i = 0;
  for (; i + 2 * W <= d; i += 2 * W) {
    s0 = vfma(vload(a + i), vload(b + i), s0);
    s1 = vfma(vload(a + i + W), vload(b + i + W), s1);
  }
  for (; i + W <= d; i += W) s0 = vfma(vload(a + i), vload(b + i), s0);
  float sum = vsum(vadd(s0, s1));
  for (; i < d; ++i) sum += a[i] * to_f32(b[i]);  // a head_dim that is not a multiple of W
  return sum;
}

// s[j] = q . k_j for the n keys at k, kstride elements apart. Keys up to `readable` may be read
// (the rest of their block): a group of W keys runs whole where it fits, and the scores past n it
// leaves in s are the caller's to ignore.
template <int DS, typename T>
inline void scores(const float* q, const T* k, int64_t kstride, int n, int readable, int d_rt, float* s) {
  const int d = DS > 0 ? DS : d_rt;
  int j = 0;
#if defined(__AVX2__) || defined(__AVX512F__)
  if (d % W == 0) {
    for (; j < n && j + W <= readable; j += W) {  // W keys at once: independent FMA chains, one reduction for all
      vf a[W];
      for (int u = 0; u < W; ++u) a[u] = vzero();
      for (int i = 0; i < d; i += W) {
        const vf qi = vload(q + i);
        for (int u = 0; u < W; ++u) a[u] = vfma(qi, vload(k + (j + u) * kstride + i), a[u]);
      }
#if defined(__AVX512F__)
      vstore(s + j, reduce16(a));
#else
      vstore(s + j, reduce8(a));
#endif
    }
  }
#endif
  for (; j < n; ++j) s[j] = dot<DS>(q, k + j * kstride, d);
}

// acc[0, NC * W) += sum_j p[j] v_j[0, NC * W): the accumulators stay in registers, two sets (even
// and odd keys) so that each FMA chain waits on its latency half as often.
template <int NC, typename T>
inline void accumulate_regs(float* acc, const float* p, const T* v, int64_t vstride, int n) {
  vf a[NC], b[NC];
  for (int c = 0; c < NC; ++c) a[c] = vload(acc + c * W), b[c] = vzero();
  int j = 0;
  for (; j + 2 <= n; j += 2) {
    const vf p0 = vset1(p[j]), p1 = vset1(p[j + 1]);
    const T *v0 = v + j * vstride, *v1 = v0 + vstride;
    for (int c = 0; c < NC; ++c) a[c] = vfma(p0, vload(v0 + c * W), a[c]);
    for (int c = 0; c < NC; ++c) b[c] = vfma(p1, vload(v1 + c * W), b[c]);
  }
  if (j < n) {
    const vf p0 = vset1(p[j]);
    for (int c = 0; c < NC; ++c) a[c] = vfma(p0, vload(v + j * vstride + c * W), a[c]);
  }
  for (int c = 0; c < NC; ++c) vstore(acc + c * W, vadd(a[c], b[c]));
}

// acc += sum_j p[j] v_j over the n rows at v, vstride elements apart: 8 vectors of acc at a time
// (a count the compiler knows, so they are registers), then any rest element by element.
template <int DS, typename T>
inline void accumulate(float* acc, const float* p, const T* v, int64_t vstride, int n, int d_rt) {
  const int d = DS > 0 ? DS : d_rt;
  int i = 0;
  if constexpr (DS > 0 && DS % W == 0 && DS / W < 8) {
    accumulate_regs<DS / W>(acc, p, v, vstride, n);
    return;
  }
  for (; i + 8 * W <= d; i += 8 * W) accumulate_regs<8>(acc + i, p, v + i, vstride, n);
  for (; i + W <= d; i += W) accumulate_regs<1>(acc + i, p, v + i, vstride, n);
  for (; i < d; ++i)
    for (int j = 0; j < n; ++j) acc[i] += p[j] * to_f32(v[j * vstride + i]);
}

// One row's scores s[0, nv) of a block into its running softmax: the max m (rescaling what acc and l
// hold under a smaller one), then s[j] = exp(s[j] - m), summed into l. s has room for whole vectors.
inline void softmax_update(float* s, int nv, int d, float& m, float& l, float* acc) {
  const int nvw = (nv + W - 1) / W * W;  // whole vectors: the lanes past nv hold -inf for the max
  for (int j = nv; j < nvw; ++j) s[j] = kNegInf;
  vf vm = vload(s);
  for (int j = W; j < nvw; j += W) vm = vmax(vm, vload(s + j));
  const float bm = vhmax(vm);
  if (bm > m) {  // a new running max: rescale what was accumulated under the old one
    if (m != kNegInf) {
      const float alpha = std::exp(m - bm);
      l *= alpha;
      for (int i = 0; i < d; ++i) acc[i] *= alpha;
    }
    m = bm;
  }
  const vf neg_m = vset1(-m);
  vf vs = vzero();
  for (int j = 0; j < nvw; j += W) {
    const vf e = vexp(vadd(vload(s + j), neg_m));
    vstore(s + j, e);
    vs = vadd(vs, e);
  }
  l += vsum(vs);  // the padding adds exp's floor (~1e-38 a lane): lost beside the real lanes
}

// rows [0, n) of one kv head's block (stride elements apart) as float32 rows of d, contiguous
template <int DS, typename T>
inline void widen_rows(const T* src, int64_t stride, int n, int d_rt, float* dst) {
  const int d = DS > 0 ? DS : d_rt;
  for (int j = 0; j < n; ++j) {
    const T* row = src + j * stride;
    float* out = dst + j * d;
    int i = 0;
    for (; i + W <= d; i += W) vstore(out + i, vload(row + i));
    for (; i < d; ++i) out[i] = to_f32(row[i]);
  }
}

}  // namespace paged
}  // namespace kvserve
