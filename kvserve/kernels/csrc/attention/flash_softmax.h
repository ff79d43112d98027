// flash_prefill.cpp's softmax between its two GEMMs: one row's block of scores to bf16
// probabilities in the exp2 domain, against a reference max that rarely moves (softmax_block).
#pragma once
#include "common/inline.h"
#include "common/vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define KVSERVE_FLASH_PREFILL 1
#endif

namespace kvserve {
namespace flash {

#ifdef KVSERVE_FLASH_PREFILL
using BF16 = c10::BFloat16;

// 2^t for finite t: 2^floor(t) (vscalefps, which flushes to 0 far below) times a degree-3 polynomial
// of the fraction t - floor(t) (vreduceps: one instruction), fitted for relative error (< 8e-5 over
// [0, 1), as the degree-4 Taylor polynomial's 6e-5 over [-1/2, 1/2]): under a twentieth of the bf16
// rounding the probabilities get next.
inline __m512 exp2_fast(__m512 t) {
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(0.07802423f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.22606723f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69583370f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99992518f));
  return _mm512_scalef_ps(p, t);
}

inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << std::max<int64_t>(n, 0)) - 1);
}

// How a call's scores become exp2 exponents: c = scale * log2(e); the soft cap (> 0) in the units
// of scale; d: the head size (of a row's output o)
struct SoftmaxScale {
  float c, scale, cap;
  int64_t d;
};

// One row's n scores (keys [from, valid) are those it may see): its probabilities as bf16 (zeros
// elsewhere) and its running sum (per lane: lanes[16], summed at the end). They are
// exp2(score - mx), mx the row's reference: the max of its first block with a key to see (mx -inf
// until then), kept for the later blocks while their probabilities stay within 2^kHeadroom. bf16
// and float32 share their exponent range, so such probabilities lose nothing and need no max pass
// and no rescaling of the output. The check costs no instruction in the loop: a lane of the
// block's own sums (at most 16 probabilities) passes 16 * 2^kHeadroom only if one of them passed
// 2^kHeadroom (or overflowed). Such a block (rare: a score far above all of the first block's)
// moves the reference to its max, rescales o and the sum, and is redone. With a soft cap the
// scores are capped in place first.
KVSERVE_INLINE void softmax_block(const SoftmaxScale& sm, float* s, BF16* p, int64_t n, int64_t from, int64_t valid,
                                  float& mx, float* lanes, float* o) {
  constexpr float kHeadroom = 64.f;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t upto = std::min(valid, n), lo = std::max<int64_t>(from, 0), k0 = lo / 16 * 16;
  if (lo >= upto) {  // no key to see here (its window starts in a later block)
    std::fill(p, p + n, BF16(0.f));
    return;
  }
  std::fill(p, p + k0, BF16(0.f));
  auto lanes_at = [&](int64_t k) { return static_cast<__mmask16>(first_lanes(upto - k) & ~first_lanes(lo - k)); };
  if (sm.cap > 0.f) {  // cap * tanh(score * scale / cap), kept in s's units (sm.c includes the scale)
    const __m512 outer = _mm512_set1_ps(sm.cap / sm.scale), inner = _mm512_set1_ps(sm.scale / sm.cap);
    for (int64_t k = k0; k < upto; k += 16)
      _mm512_storeu_ps(s + k, _mm512_mul_ps(outer, vec::vtanh(_mm512_mul_ps(_mm512_loadu_ps(s + k), inner))));
  }
  auto block_max = [&] {
    __m512 vmax = neg_inf;
    for (int64_t k = k0; k < upto; k += 16) vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(neg_inf, lanes_at(k), s + k));
    return _mm512_reduce_max_ps(vmax) * sm.c;
  };
  if (mx == -std::numeric_limits<float>::infinity()) mx = block_max();
  const __m512 cv = _mm512_set1_ps(sm.c);
  for (;;) {
    const __m512 mv = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps(), sum2 = _mm512_setzero_ps();
    int64_t k = k0;
    if (lo > k0) {  // the window starts inside this vector
      const __mmask16 live = lanes_at(k);
      const __m512 e = _mm512_maskz_mov_ps(live, exp2_fast(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(live, s + k), cv, mv)));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + k), (__m256i)_mm512_cvtneps_pbh(e));
      k += 16;
    }
    for (; k + 32 <= upto; k += 32) {  // two vectors a turn: two dependency chains, one bf16 conversion
      const __m512 e0 = exp2_fast(_mm512_fmsub_ps(_mm512_loadu_ps(s + k), cv, mv));
      const __m512 e1 = exp2_fast(_mm512_fmsub_ps(_mm512_loadu_ps(s + k + 16), cv, mv));
      sum = _mm512_add_ps(sum, e0);
      sum2 = _mm512_add_ps(sum2, e1);
      _mm512_storeu_si512(p + k, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    sum = _mm512_add_ps(sum, sum2);
    for (; k + 16 <= upto; k += 16) {
      const __m512 e = exp2_fast(_mm512_fmsub_ps(_mm512_loadu_ps(s + k), cv, mv));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + k), (__m256i)_mm512_cvtneps_pbh(e));
    }
    if (k < upto) {
      const __mmask16 live = first_lanes(upto - k);
      const __m512 x = _mm512_maskz_loadu_ps(live, s + k);
      const __m512 e = _mm512_maskz_mov_ps(live, exp2_fast(_mm512_fmsub_ps(x, cv, mv)));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + k), (__m256i)_mm512_cvtneps_pbh(e));
      k += 16;
    }
    for (; k < n; k += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + k), _mm256_setzero_si256());
    if (!_mm512_cmp_ps_mask(sum, _mm512_set1_ps(16.f * std::exp2(kHeadroom)), _CMP_GT_OQ)) {  // the usual case
      _mm512_storeu_ps(lanes, _mm512_add_ps(_mm512_loadu_ps(lanes), sum));
      return;
    }
    const float top = block_max();
    const __m512 scale = _mm512_set1_ps(std::exp2(mx - top));
    _mm512_storeu_ps(lanes, _mm512_mul_ps(_mm512_loadu_ps(lanes), scale));
    for (int64_t c = 0; c < sm.d; c += 16) _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(o + c), scale));
    mx = top;
  }
}
#endif

}  // namespace flash
}  // namespace kvserve
