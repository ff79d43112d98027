// Attention over a bf16 KV cache with AVX512-BF16 pair dot products (vdpbf16ps), for
// paged_attention.cpp: q . k straight from the cache, p . v over pairs of V rows interleaved once per
// block. Where the compiler does not target AVX512-BF16, kBF16Dot is false and the helpers are only declared.
#pragma once
#include "vec.h"

#include <algorithm>
#include <cstdint>

namespace kvserve {
namespace bf16dot {

using vec::BF16;

#if defined(__AVX512BF16__)
// With AVX512-BF16, a bf16 cache is read as stored: q . k and p . v as bf16 pair dot products
// (vdpbf16ps: exact products, float32 sums) over q and the probabilities rounded to bf16, as bf16
// attention on the AMX prefill path does; no widening of K or V.
constexpr bool kBF16Dot = true;
using vec::reduce16;

// s[j] = q . k_j for the n keys at k (bf16 rows kstride apart), q as bf16 [DS]: 16 keys at a time where
// `readable` allows (see scores()), the rest one by one.
template <int DS>
inline void scores_bf16(const uint16_t* q, const BF16* k, int64_t kstride, int n, int readable, float* s) {
  constexpr int C = DS / 32;
  __m512bh qv[C];
  for (int c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  int j = 0;
  for (; j < n && j + 16 <= readable; j += 16) {
    __m512 a[16];
    for (int u = 0; u < 16; ++u) {
      a[u] = _mm512_setzero_ps();
      for (int c = 0; c < C; ++c)
        a[u] = _mm512_dpbf16_ps(a[u], qv[c], (__m512bh)_mm512_loadu_si512(k + (j + u) * kstride + 32 * c));
    }
    _mm512_storeu_ps(s + j, reduce16(a));
  }
  for (; j < n; ++j) {
    __m512 a = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(k + j * kstride + 32 * c));
    s[j] = _mm512_reduce_add_ps(a);
  }
}

// The n rows at v (bf16, vstride apart) as pairs of rows interleaved for vdpbf16ps: pair i, vector z of
// DS / 16 holds (v[2i][dim], v[2i + 1][dim]) for the 16 dims that z covers (see unpermute_bf16); a
// missing last row of an odd n reads as zeros.
template <int DS>
inline void pair_rows(const BF16* v, int64_t vstride, int n, uint16_t* out) {
  constexpr int C = DS / 32;
  for (int i = 0; 2 * i < n; ++i) {
    const BF16* r0 = v + 2 * i * vstride;
    for (int c = 0; c < C; ++c) {
      const __m512i a = _mm512_loadu_si512(r0 + 32 * c);
      const __m512i b = 2 * i + 1 < n ? _mm512_loadu_si512(r0 + vstride + 32 * c) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + (i * 2 * C + 2 * c) * 32, _mm512_unpacklo_epi16(a, b));
      _mm512_storeu_si512(out + (i * 2 * C + 2 * c + 1) * 32, _mm512_unpackhi_epi16(a, b));
    }
  }
}

// acc (in pair_rows' dim order) += sum_j p_j v_j over n keys, p rounded to bf16
template <int DS>
inline void accumulate_bf16(float* acc, const float* p, const uint16_t* vpairs, int n, uint16_t* pb) {
  constexpr int Z = DS / 16;
  for (int j = 0; j < n; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + j)));
  if (n % 2) pb[n] = 0;  // the zero row's weight
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(pb);
  __m512 a[Z];
#pragma GCC unroll 16
  for (int z = 0; z < Z; ++z) a[z] = _mm512_loadu_ps(acc + 16 * z);
  for (int i = 0; 2 * i < n; ++i) {
    const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[i]));
#pragma GCC unroll 16
    for (int z = 0; z < Z; ++z) a[z] = _mm512_dpbf16_ps(a[z], w, (__m512bh)_mm512_loadu_si512(vpairs + (i * Z + z) * 32));
  }
#pragma GCC unroll 16
  for (int z = 0; z < Z; ++z) _mm512_storeu_ps(acc + 16 * z, a[z]);
}

// acc [DS] from pair_rows' order (position 16 z + k: dim 32 (z / 2) + 8 (k / 4) + 4 (z % 2) + k % 4) to dims
template <int DS>
inline void unpermute_bf16(float* acc) {
  float tmp[DS];
  for (int z = 0; z < DS / 16; ++z)
    for (int k = 0; k < 16; ++k) tmp[32 * (z / 2) + 8 * (k / 4) + 4 * (z % 2) + k % 4] = acc[16 * z + k];
  std::copy(tmp, tmp + DS, acc);
}
#else
constexpr bool kBF16Dot = false;
// declared for paged_attention.cpp's `if constexpr (kBF16Dot ...)` branches, which never call them here
template <int DS> void scores_bf16(const uint16_t* q, const BF16* k, int64_t kstride, int n, int readable, float* s);
template <int DS> void pair_rows(const BF16* v, int64_t vstride, int n, uint16_t* out);
template <int DS> void accumulate_bf16(float* acc, const float* p, const uint16_t* vpairs, int n, uint16_t* pb);
template <int DS> void unpermute_bf16(float* acc);
#endif

}  // namespace bf16dot
}  // namespace kvserve
