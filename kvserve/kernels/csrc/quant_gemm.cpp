// Weight-only quantized linear layers: y[M,N] = x[M,K] @ W[N,K]^T with W in blocks of 32 along K.
//
//   kvserve::q8_0_linear(x, qs, d)     W = d * q,      qs int8  [N, K],   d fp16 [N, K/32]
//   kvserve::q4_1_linear(x, qs, d, m)  W = d * q + m,  qs uint8 [N, K/2], d, m fp16 [N, K/32]
//                                      (byte j of a block: q[j] low nibble, q[j+16] high nibble)
//
// Decode is bound by the bytes of the weights, so they stay quantized in memory and are never
// expanded to floats. Each row of x is quantized on the fly to int8 per 32-block (one scale per
// block, plus the block's float sum for Q4_1's min term), so a block's dot product is integer
// (u8 x s8 multiply-adds) and is scaled once: sum_k w_k x_k = dw*dx*sum(q*qx) + m*sum(x).
// Output columns are split across threads; each thread computes tiles of a few rows x a few
// columns so that a weight block loaded into registers serves several rows.
#include "common.h"

#include <cmath>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t QK = 32;  // weights per block

inline float half_to_float(uint16_t bits) {
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// x quantized per 32-block: q int8 [M, K], d (scale) and s (float sum of the block) [M, K/32]
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / QK;
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb)};
  // 2,048 blocks (64k values) per thread: smaller inputs quantize on one thread (a region costs more)
  at::parallel_for(0, M * nb, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* v = x + (i / nb) * K + (i % nb) * QK;  // block i % nb of row i / nb
      float amax = 0.f, sum = 0.f;
      for (int k = 0; k < QK; ++k) {
        amax = std::max(amax, std::fabs(v[k]));
        sum += v[k];
      }
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* q = r.q.data() + (i / nb) * K + (i % nb) * QK;
      for (int k = 0; k < QK; ++k) q[k] = static_cast<int8_t>(std::nearbyint(v[k] * inv));
      r.d[i] = amax / 127.f;
      r.s[i] = sum;
    }
  });
  return r;
}

struct Weights {
  const uint8_t* qs;     // row n, block b at qs + (n * nb + b) * block_bytes
  const uint16_t* d;     // fp16 bits [N, nb]
  const uint16_t* m;     // fp16 bits [N, nb], Q4_1 only
  int64_t nb;
};

#if defined(__AVX2__)
// 8 int32 lanes, each the sum of 4 products u8 * s8. maddubs saturates its pairwise i16 sums, which
// our operands never reach: u <= 15 (Q4) or u = |q| <= 128 (Q8), times |x| <= 127, twice < 2^15.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One block of 32 weights of column n as 32 bytes in element order (Q4: values 0..15).
template <bool Q4>
inline __m256i load_block(const Weights& w, int64_t n, int64_t b) {
  if constexpr (Q4) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + (n * w.nb + b) * 16));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(packed, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
    return _mm256_set_m128i(hi, lo);
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + (n * w.nb + b) * 32));
  }
}

// Rows [m0, m0+MR) x columns [n0, n0+NR) of y.
template <bool Q4, int MR, int NR>
void tile(const Weights& w, const QuantizedRows& a, int64_t K, int64_t m0, int64_t n0, float* y, int64_t N) {
  __m256 acc[MR][NR];
  float min_acc[MR][NR] = {};
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.nb; ++b) {
    __m256i wq[NR];
    float dw[NR], mw[NR];
    for (int j = 0; j < NR; ++j) {
      wq[j] = load_block<Q4>(w, n0 + j, b);
      dw[j] = half_to_float(w.d[(n0 + j) * w.nb + b]);
      if constexpr (Q4) mw[j] = half_to_float(w.m[(n0 + j) * w.nb + b]);
    }
    for (int i = 0; i < MR; ++i) {
      const int64_t row = m0 + i;
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + row * K + b * QK));
      const float dx = a.d[row * w.nb + b];
      for (int j = 0; j < NR; ++j) {
        __m256i p;
        if constexpr (Q4) {
          p = dot_u8s8(wq[j], xq);  // Q4 values are unsigned already
        } else {  // s8 * s8 as |w| * (x with w's sign): maddubs wants one unsigned operand
          p = dot_u8s8(_mm256_sign_epi8(wq[j], wq[j]), _mm256_sign_epi8(xq, wq[j]));
        }
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw[j] * dx), acc[i][j]);
        if constexpr (Q4) min_acc[i][j] += mw[j] * a.s[row * w.nb + b];
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[(m0 + i) * N + n0 + j] = hsum(acc[i][j]) + min_acc[i][j];
}
#else
template <bool Q4, int MR, int NR>
void tile(const Weights& w, const QuantizedRows& a, int64_t K, int64_t m0, int64_t n0, float* y, int64_t N) {
  for (int i = 0; i < MR; ++i) {
    const int64_t row = m0 + i;
    for (int j = 0; j < NR; ++j) {
      const int64_t n = n0 + j;
      float total = 0.f;
      for (int64_t b = 0; b < w.nb; ++b) {
        const int8_t* xq = a.q.data() + row * K + b * QK;
        int32_t dot = 0;
        if constexpr (Q4) {
          const uint8_t* p = w.qs + (n * w.nb + b) * 16;
          for (int k = 0; k < 16; ++k) dot += (p[k] & 0x0F) * xq[k] + (p[k] >> 4) * xq[k + 16];
        } else {
          const int8_t* p = reinterpret_cast<const int8_t*>(w.qs + (n * w.nb + b) * 32);
          for (int k = 0; k < 32; ++k) dot += p[k] * xq[k];
        }
        total += half_to_float(w.d[n * w.nb + b]) * a.d[row * w.nb + b] * static_cast<float>(dot);
        if constexpr (Q4) total += half_to_float(w.m[n * w.nb + b]) * a.s[row * w.nb + b];
      }
      y[row * N + n] = total;
    }
  }
}
#endif

#if defined(__AVX2__)
constexpr int NR = 8;  // columns per tile: one lane each of an 8-float accumulator
constexpr int PREFETCH_TILES = 2;  // how far ahead tile8 prefetches

// Lane j = the sum of the 8 int32 lanes of p[j]: 8 dot products reduced at once.
inline __m256i reduce8(const __m256i p[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  // a = [cols 0-3 low half | cols 0-3 high half], b the same for cols 4-7
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// Columns [n0, n0+8) for every row. Each weight block is unpacked once and serves all M rows;
// the 8 columns' partial sums of a row live in one vector (kept in ``acc``, M x 8 floats), so a
// block costs one convert and one scale-multiply per row, not one per column.
template <bool Q4>
void tile8(const Weights& w, const QuantizedRows& a, int64_t M, int64_t K, int64_t n0, float* y, int64_t N,
           std::vector<float>& acc) {
  acc.assign(M * NR, 0.f);
  // Prefetch a tile ahead, a share of its cache lines per block step. A tile's 8 columns are one
  // contiguous run of bytes, read here as 8 interleaved streams of a few lines each: too short for
  // the hardware prefetcher to ramp up, so a decode (M=1, bound by bytes) waited on memory.
  constexpr int64_t block_bytes = Q4 ? QK / 2 : QK;
  const int64_t tile_bytes = NR * w.nb * block_bytes;
  const char* ahead = reinterpret_cast<const char*>(w.qs) + (n0 + PREFETCH_TILES * NR) * w.nb * block_bytes;
  const char* ahead_d = reinterpret_cast<const char*>(w.d + (n0 + PREFETCH_TILES * NR) * w.nb);
  const char* ahead_m = Q4 ? reinterpret_cast<const char*>(w.m + (n0 + PREFETCH_TILES * NR) * w.nb) : nullptr;
  for (int64_t b = 0; b < w.nb; ++b) {
    for (int64_t off = b * tile_bytes / w.nb & ~int64_t{63}; off < (b + 1) * tile_bytes / w.nb; off += 64)
      _mm_prefetch(ahead + off, _MM_HINT_T0);  // a prefetch never faults, even past the end
    if (b * 64 < NR * w.nb * 2) {  // the scales: 2 bytes a block
      _mm_prefetch(ahead_d + b * 64, _MM_HINT_T0);
      if constexpr (Q4) _mm_prefetch(ahead_m + b * 64, _MM_HINT_T0);
    }
    __m256i wq[NR], wabs[NR];
    alignas(32) float dw[NR], mw[NR];
    for (int j = 0; j < NR; ++j) {
      wq[j] = load_block<Q4>(w, n0 + j, b);
      wabs[j] = Q4 ? wq[j] : _mm256_sign_epi8(wq[j], wq[j]);
      dw[j] = half_to_float(w.d[(n0 + j) * w.nb + b]);
      mw[j] = Q4 ? half_to_float(w.m[(n0 + j) * w.nb + b]) : 0.f;
    }
    const __m256 dwv = _mm256_load_ps(dw), mwv = _mm256_load_ps(mw);
    for (int64_t row = 0; row < M; ++row) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + row * K + b * QK));
      __m256i p[NR];
      for (int j = 0; j < NR; ++j)  // Q8: s8 * s8 as |w| * (x with w's sign); Q4 values are unsigned already
        p[j] = dot_u8s8(wabs[j], Q4 ? xq : _mm256_sign_epi8(xq, wq[j]));
      float* out = acc.data() + row * NR;
      __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(p)),
                                   _mm256_mul_ps(dwv, _mm256_set1_ps(a.d[row * w.nb + b])), _mm256_loadu_ps(out));
      if constexpr (Q4) sum = _mm256_fmadd_ps(mwv, _mm256_set1_ps(a.s[row * w.nb + b]), sum);
      _mm256_storeu_ps(out, sum);
    }
  }
  for (int64_t row = 0; row < M; ++row)
    for (int j = 0; j < NR; ++j) y[row * N + n0 + j] = acc[row * NR + j];
}
#else
constexpr int NR = 8;
#endif

template <bool Q4>
void columns(const Weights& w, const QuantizedRows& a, int64_t M, int64_t K, int64_t c0, int64_t c1, float* y,
             int64_t N) {
  int64_t n = c0;
#if defined(__AVX2__)
  std::vector<float> acc;
  for (; n + NR <= c1; n += NR) tile8<Q4>(w, a, M, K, n, y, N, acc);
#endif
  for (; n < c1; ++n)
    for (int64_t m = 0; m < M; ++m) tile<Q4, 1, 1>(w, a, K, m, n, y, N);
}

template <bool Q4>
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor* m) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK(x.device().is_cpu() && qs.device().is_cpu(), "quantized linear: CPU tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
  TORCH_CHECK(K % QK == 0, "quantized linear: K (", K, ") must be a multiple of 32");
  TORCH_CHECK(qs.dim() == 2 && qs.size(1) == (Q4 ? K / 2 : K) && qs.is_contiguous(), "qs has the wrong shape");
  TORCH_CHECK(qs.scalar_type() == (Q4 ? at::kByte : at::kChar), "qs has the wrong dtype");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.numel() == N * (K / QK), "d: fp16 [N, K/32]");
  if (m != nullptr)
    TORCH_CHECK(m->scalar_type() == at::kHalf && m->is_contiguous() && m->numel() == N * (K / QK), "m: fp16 [N, K/32]");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const QuantizedRows a = quantize_rows(xc.data_ptr<float>(), M, K);
  const Weights w{reinterpret_cast<const uint8_t*>(qs.data_ptr()), reinterpret_cast<const uint16_t*>(d.data_ptr()),
                  m != nullptr ? reinterpret_cast<const uint16_t*>(m->data_ptr()) : nullptr, K / QK};
  float* out = y.data_ptr<float>();
  // Work is split by column tiles, at least ~256 KB of weights x rows per thread: a decode's small
  // layers (M=1, a few hundred KB) run on one thread, since waking another costs more than it saves.
  const int64_t tiles = (N + NR - 1) / NR;
  const int64_t tile_bytes = NR * (K / QK) * (Q4 ? QK / 2 : QK);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (tile_bytes * M));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    columns<Q4>(w, a, M, K, t0 * NR, std::min(N, t1 * NR), out, N);
  });
  return y;
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  return quant_linear<false>(x, qs, d, nullptr);
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  return quant_linear<true>(x, qs, d, &m);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("q8_0_linear(Tensor x, Tensor qs, Tensor d) -> Tensor", &q8_0_linear);
  m.def("q4_1_linear(Tensor x, Tensor qs, Tensor d, Tensor m) -> Tensor", &q4_1_linear);
}
