// Shared helpers of the kvserve CPU kernels: vector width macros and small vector maths.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define KVSERVE_SIMD "avx512"
#elif defined(__AVX2__)
#define KVSERVE_SIMD "avx2"
#else
#define KVSERVE_SIMD "scalar"
#endif

namespace kvserve {

#if defined(__AVX2__) && defined(__FMA__)
#define KVSERVE_EXP_PS 1
// exp(x) for 8 floats: 2^(x log2 e) split into an integer power (exponent bits) and 2^f, |f| <= 1/2,
// by its degree-7 Taylor polynomial (relative error ~1e-8, below fp32's epsilon). x is clamped to
// [-87, 88]: below, ~1e-38 instead of 0; above, ~1.6e38 instead of inf.
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.525273380405984e-05f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381606e-04f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618129107628477e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550410866482158e-02f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402265069591007e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931471805599453e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}
#endif

}  // namespace kvserve
