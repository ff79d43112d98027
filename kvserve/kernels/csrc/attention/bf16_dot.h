// Attention over a bf16 KV cache with AVX512-BF16 pair dot products (vdpbf16ps), for
// paged_items.cpp: q . k straight from the cache, p . v over pairs of V rows interleaved once per
// block. Where the compiler does not target AVX512-BF16, kBF16Dot is false and the helpers are only declared.
#pragma once
#include "common/vec.h"

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

// Up to 16 keys (n >= 1; rows `stride` apart from k and v) of one kv head for the G query heads of one
// decode token, all at once: each head's scores, its running softmax without branches (m: the max so
// far; lv: per-lane sums of the exps, summed across lanes at the end; acc scaled by exp(m_old - m)),
// then p . V with V's row pairs interleaved in registers once for all G heads (pair_rows' order, see
// unpermute_bf16). q: the G heads' scaled bf16 rows [G, DS]; acc [G, DS]; s: scratch of 16 G floats.
// The same arithmetic as scores_bf16 + softmax_update + accumulate_bf16 per head; here the heads'
// dependency chains interleave, and the keys past n are masked rather than branched around. lv: [G, 16].
// Keys before lo (a sliding window's start; lo < n) are masked too; cap > 0: the scores' soft cap.
template <int DS, int G>
inline void decode_keys_bf16(const uint16_t* q, const BF16* k, const BF16* v, int64_t stride, int n, int readable,
                             int lo, float cap, float* m, float* lv, float* acc, float* s) {
  constexpr int Z = DS / 16, C = DS / 32;
  for (int g = 0; g < G; ++g) scores_bf16<DS>(q + g * DS, k, stride, n, readable, s + 16 * g);
  if (cap > 0.f) vec::softcap_scores(s, 16 * G, cap);
  const __mmask16 valid = static_cast<__mmask16>((n >= 16 ? 0xFFFFu : (1u << n) - 1) & ~((1u << lo) - 1));
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  uint32_t pairs[G][8];
  __m512 alpha[G];
  for (int g = 0; g < G; ++g) {
    const __m512 sv = _mm512_mask_blend_ps(valid, neg_inf, _mm512_loadu_ps(s + 16 * g));
    const float mn = std::max(m[g], _mm512_reduce_max_ps(sv));
    alpha[g] = mn > m[g] ? vec::vexp(_mm512_set1_ps(m[g] - mn)) : _mm512_set1_ps(1.f);
    const __m512 p = _mm512_maskz_mov_ps(valid, vec::vexp(_mm512_sub_ps(sv, _mm512_set1_ps(mn))));
    _mm512_storeu_ps(lv + 16 * g, _mm512_fmadd_ps(_mm512_loadu_ps(lv + 16 * g), alpha[g], p));
    m[g] = mn;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs[g]), (__m256i)_mm512_cvtneps_pbh(p));
  }
  __m512 a[G][Z];
  for (int g = 0; g < G; ++g)
    for (int z = 0; z < Z; ++z) a[g][z] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * DS + 16 * z), alpha[g]);
  for (int i = 0; 2 * i < n; ++i) {
    const BF16* r0 = v + 2 * i * stride;
    const bool second = 2 * i + 1 < n;  // an odd n's last pair: its missing row reads as zeros
    __m512i lo[C], hi[C];
    for (int c = 0; c < C; ++c) {
      const __m512i x = _mm512_loadu_si512(r0 + 32 * c);
      const __m512i y = second ? _mm512_loadu_si512(r0 + stride + 32 * c) : _mm512_setzero_si512();
      lo[c] = _mm512_unpacklo_epi16(x, y), hi[c] = _mm512_unpackhi_epi16(x, y);
    }
    for (int g = 0; g < G; ++g) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[g][i]));
      for (int c = 0; c < C; ++c) {
        a[g][2 * c] = _mm512_dpbf16_ps(a[g][2 * c], w, (__m512bh)lo[c]);
        a[g][2 * c + 1] = _mm512_dpbf16_ps(a[g][2 * c + 1], w, (__m512bh)hi[c]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int z = 0; z < Z; ++z) _mm512_storeu_ps(acc + g * DS + 16 * z, a[g][z]);
}

// the sum of 16 floats (decode_keys_bf16's per-lane sums)
inline float sum16(const float* x) { return _mm512_reduce_add_ps(_mm512_loadu_ps(x)); }

// acc [DS] from pair_rows' order (position 16 z + k: dim 32 (z / 2) + 8 (k / 4) + 4 (z % 2) + k % 4) to dims
// in registers: vectors 2c and 2c + 1 hold dims 32c.. as 4-dim quarters a0 b0 a1 b1 | a2 b2 a3 b3 of
// the two; scattered scalar stores read back as vectors would stall on store forwarding instead
template <int DS>
inline void unpermute_bf16(float* acc) {
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int c = 0; c < DS / 32; ++c) {
    const __m512 a = _mm512_loadu_ps(acc + 32 * c), b = _mm512_loadu_ps(acc + 32 * c + 16);
    _mm512_storeu_ps(acc + 32 * c, _mm512_permutex2var_ps(a, lo, b));
    _mm512_storeu_ps(acc + 32 * c + 16, _mm512_permutex2var_ps(a, hi, b));
  }
}
#else
constexpr bool kBF16Dot = false;
// declared for paged_items.cpp's `if constexpr (kBF16Dot ...)` branches, which never call them here
template <int DS> void scores_bf16(const uint16_t* q, const BF16* k, int64_t kstride, int n, int readable, float* s);
template <int DS> void pair_rows(const BF16* v, int64_t vstride, int n, uint16_t* out);
template <int DS> void accumulate_bf16(float* acc, const float* p, const uint16_t* vpairs, int n, uint16_t* pb);
template <int DS> void unpermute_bf16(float* acc);
float sum16(const float* x);
template <int DS, int G>
void decode_keys_bf16(const uint16_t* q, const BF16* k, const BF16* v, int64_t stride, int n, int readable, int lo,
                      float cap, float* m, float* lv, float* acc, float* s);
#endif

}  // namespace bf16dot
}  // namespace kvserve
