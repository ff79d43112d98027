// One vector of floats for the kernels: AVX512 (16 lanes), AVX2 (8 lanes) or scalar (1 lane), as
// the compiler targets, with the few operations the kernels need (and exp, and the W horizontal sums
// of W vectors at once). Loads widen bf16 and the 8-bit KV cache's int8 / fp8 (e4m3, e5m2) values to
// floats.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cstdint>

#include <algorithm>
#include <cmath>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvserve {
namespace vec {

using BF16 = c10::BFloat16;
using FP8E4M3 = c10::Float8_e4m3fn;
using FP8E5M2 = c10::Float8_e5m2;

// fp8 widens through fp16 (F16C): e5m2 is the top byte of an fp16; e4m3's sign, exponent and
// mantissa fit fp16's fields with an exponent bias 8 lower, so its fp16 reading is the value / 2^8
// (subnormals included).
constexpr float kE4M3FromHalf = 256.f;

#if defined(__AVX512F__)
constexpr int W = 16;
using vf = __m512;
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const BF16* p) {  // bf16 -> fp32 is a 16-bit shift
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vf vload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vf vload(const FP8E5M2* p) {
  const __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(u, 8));
}
inline vf vload(const FP8E4M3* p) {
  const __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(kE4M3FromHalf));
}
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline __m512i bf16_bits(vf x) {  // the bf16 nearest x (ties to even) in each lane's top half
  const __m512i i = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(i, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(i, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
}
#if defined(__AVX512BF16__)
// the same rounding (nearest, ties to even) in one instruction where the CPU converts to bf16 natively
inline vf vround_bf16(vf x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}
inline void vstore(BF16* p, vf x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x)); }
#else
inline vf vround_bf16(vf x) {
  return _mm512_castsi512_ps(_mm512_and_si512(bf16_bits(x), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void vstore(BF16* p, vf x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(x), 16)));
}
#endif
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vrcp(vf b) { return _mm512_rcp14_ps(b); }  // 1 / b to 2^-14
inline vf vzero_below(vf x, float lo, vf e) {  // e where x >= lo, else 0 (NaN x: 0)
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(lo), _CMP_GE_OQ), e);
}
inline float vsum(vf x) { return _mm512_reduce_add_ps(x); }
inline float vhmax(vf x) { return _mm512_reduce_max_ps(x); }
inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vscale2(vf p, vf n) {  // p * 2^n, n integral
  __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
}
#elif defined(__AVX2__)
constexpr int W = 8;
using vf = __m256;
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const BF16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vf vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#if defined(__F16C__)
inline vf vload(const FP8E5M2* p) {
  const __m128i u = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(u, 8));
}
inline vf vload(const FP8E4M3* p) {
  const __m128i u = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(u, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(u, _mm_set1_epi16(0x7F)), 7));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(kE4M3FromHalf));
}
#else  // no F16C: element by element
template <typename T>
inline vf vload_each(const T* p) {
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(f);
}
inline vf vload(const FP8E5M2* p) { return vload_each(p); }
inline vf vload(const FP8E4M3* p) { return vload_each(p); }
#endif
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline __m256i bf16_bits(vf x) {  // the bf16 nearest x (ties to even) in each lane's top half
  const __m256i i = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(i, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(i, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
}
inline vf vround_bf16(vf x) {
  return _mm256_castsi256_ps(_mm256_and_si256(bf16_bits(x), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void vstore(BF16* p, vf x) {
  const __m256i r = _mm256_srli_epi32(bf16_bits(x), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vzero() { return _mm256_setzero_ps(); }
#if defined(__FMA__)
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
#else
inline vf vfma(vf a, vf b, vf c) { return _mm256_add_ps(_mm256_mul_ps(a, b), c); }
#endif
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vrcp(vf b) { return _mm256_rcp_ps(b); }  // 1 / b to 1.5 x 2^-12
inline vf vzero_below(vf x, float lo, vf e) { return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(lo), _CMP_GE_OQ), e); }
inline float vsum(vf x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
inline float vhmax(vf x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}
inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vscale2(vf p, vf n) {
  __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}
#else
constexpr int W = 1;
using vf = float;
inline vf vload(const float* p) { return *p; }
inline vf vload(const BF16* p) { return static_cast<float>(*p); }
inline vf vload(const int8_t* p) { return static_cast<float>(*p); }
inline vf vload(const FP8E5M2* p) { return static_cast<float>(*p); }
inline vf vload(const FP8E4M3* p) { return static_cast<float>(*p); }
inline void vstore(float* p, vf x) { *p = x; }
inline void vstore(BF16* p, vf x) { *p = static_cast<BF16>(x); }
inline vf vround_bf16(vf x) { return static_cast<float>(static_cast<BF16>(x)); }
inline vf vset1(float x) { return x; }
inline vf vzero() { return 0.f; }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline vf vmul(vf a, vf b) { return a * b; }
inline vf vadd(vf a, vf b) { return a + b; }
inline vf vsub(vf a, vf b) { return a - b; }
inline vf vmax(vf a, vf b) { return std::max(a, b); }
inline vf vmin(vf a, vf b) { return std::min(a, b); }
inline vf vdiv(vf a, vf b) { return a / b; }
inline vf vrcp(vf b) { return 1.f / b; }
inline vf vzero_below(vf x, float lo, vf e) { return x >= lo ? e : 0.f; }
inline float vsum(vf x) { return x; }
inline float vhmax(vf x) { return x; }
#endif

// exp(x). Vector paths: 2^(x log2 e) split into an integer power (exponent bits) and 2^f, |f| <= 1/2,
// by its Taylor polynomial of degree Degree: 7 (vexp) is within ~1e-8 relative, below fp32's epsilon;
// 5 (vexp_for_bf16) within ~3e-6, for results rounded to bf16 next (2^-9), where the two extra terms
// only cost time (the bf16 MLP's silu). x is clamped to [-87, 88]: below, ~1e-38 instead of 0;
// above, ~1.6e38 instead of inf.
template <int Degree>
inline vf vexp_taylor(vf x) {
#if defined(__AVX2__) || defined(__AVX512F__)
  static_assert(Degree >= 1 && Degree <= 7, "coefficients up to degree 7");
  constexpr float c[8] = {1.0f, 6.931471805599453e-01f, 2.402265069591007e-01f, 5.550410866482158e-02f,
                          9.618129107628477e-03f, 1.3333558146428443e-03f, 1.5403530393381606e-04f,
                          1.525273380405984e-05f};  // ln(2)^k / k!
  x = vmin(vmax(x, vset1(-87.0f)), vset1(88.0f));
  vf t = vmul(x, vset1(1.4426950408889634f));
  vf n = vround(t);
  vf f = vfma(n, vset1(-1.0f), t);
  vf p = vset1(c[Degree]);
#pragma GCC unroll 8
  for (int k = Degree - 1; k >= 0; --k) p = vfma(p, f, vset1(c[k]));
  return vscale2(p, n);
#else
  return std::exp(x);
#endif
}
inline vf vexp(vf x) { return vexp_taylor<7>(x); }
inline vf vexp_for_bf16(vf x) { return vexp_taylor<5>(x); }

// tanh(x) = 1 - 2 / (exp(2x) + 1): exp's clamp keeps both ends at +-1 (no inf / inf); ~1e-7 absolute
inline vf vtanh(vf x) { return vsub(vset1(1.f), vdiv(vset1(2.f), vadd(vexp(vadd(x, x)), vset1(1.f)))); }

// Attention's soft cap on scores, cap * tanh(s / cap) (Gemma 2), over s[0, n) in whole vectors: s
// must have room up to n rounded up to W (the lanes past n are the caller's to ignore).
inline void softcap_scores(float* s, int n, float cap) {
  const vf c = vset1(cap), inv = vset1(1.f / cap);
  for (int j = 0; j < n; j += W) vstore(s + j, vmul(c, vtanh(vmul(vload(s + j), inv))));
}

// A softmax term exp((x - m) * inv_t) for the samplers (sample_rows.cpp's draw, amx_head.cpp's head): W
// lanes with neg_m = -m, or one float; 0 where the exponent is below exp's range (-inf or NaN logits).
constexpr float kExpFloor = -87.0f;
inline vf scaled_exp(vf x, vf neg_m, vf inv_t) {
  const vf t = vmul(vadd(x, neg_m), inv_t);
  return vzero_below(t, kExpFloor, vexp(t));
}
inline float scaled_exp1(float x, float m, float inv_t) {
  const float t = (x - m) * inv_t;
  return t >= kExpFloor ? std::exp(t) : 0.f;
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// The 8 horizontal sums of a[0..7], as one vector.
__attribute__((always_inline)) inline vf reduce8(const vf* a) {
  vf t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  vf t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  vf u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half: sums of a0..3, a4..7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

#if defined(__AVX512F__)
// The 16 horizontal reductions of a[0..15] by `op` (add, max), as one vector (lane u: a[u]'s lanes
// reduced): pairs folded within 128-bit lanes, then quads, then across the 128-bit lanes. 45
// shuffles and ops where 16 separate reductions take ~130.
template <typename Op>
__attribute__((always_inline)) inline vf reduce16_by(const vf* a, Op op) {
  vf b[8], c[4];
  for (int u = 0; u < 8; ++u)  // per 128-bit lane: two partials of a[2u], two of a[2u + 1]
    b[u] = op(_mm512_unpacklo_ps(a[2 * u], a[2 * u + 1]), _mm512_unpackhi_ps(a[2 * u], a[2 * u + 1]));
  for (int u = 0; u < 4; ++u)  // per 128-bit lane: that lane's partials of a[4u .. 4u + 3]
    c[u] = op(_mm512_shuffle_ps(b[2 * u], b[2 * u + 1], _MM_SHUFFLE(1, 0, 1, 0)),
              _mm512_shuffle_ps(b[2 * u], b[2 * u + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const vf e0 = op(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),
                   _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const vf e1 = op(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(1, 0, 1, 0)),
                   _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return op(_mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(3, 1, 3, 1)));
}
__attribute__((always_inline)) inline vf reduce16(const vf* a) { return reduce16_by(a, [](vf x, vf y) { return vadd(x, y); }); }
__attribute__((always_inline)) inline vf reduce16_max(const vf* a) { return reduce16_by(a, [](vf x, vf y) { return vmax(x, y); }); }
#endif

}  // namespace vec
}  // namespace kvserve
