// Weight-only quantized linear layers: y[M,N] = x[M,K] @ W[N,K]^T with W in blocks of 32 along K,
// read from a packed copy made once at load.
//
//   kvserve::pack_quant(qs, d, m?)                  the layout of kvserve/model/quant.py -> packed bytes
//   kvserve::packed_linear(x, packed, kind, n)      y = x @ W^T, x float32 [M, K]
//   kvserve::dequantize_packed(packed, kind, n, k)  W as float32 [N, K]
//
// kind "q8_0": W = d * q (q int8); kind "q4_1": W = d * q + m, and "q4_0": W = d * (q - 8) (q 0..15,
// two per byte: byte j of a column's block holds q[j] low and q[j + 16] high, as in GGUF).
//
// Packed layout: output columns in tiles of 8, one tile after another; within a tile its K/32
// blocks one after another, and a block holds the 8 columns' values and then their fp16 scales:
//   q8_0: 8 groups of 4 along K, each the 8 columns' 4 bytes (q8_offset), 8 fp16 d   272 bytes
//   q4_1: 8 x 16 bytes of nibbles, 8 fp16 d, 8 fp16 m (column order)              160 bytes
//   q4_0: the same without the m                                                   144 bytes
// (Q4's nibbles pair columns k and k + 4 in each 32 bytes, k = 0..3.) So a thread reads its columns
// as one sequential stream, and a block's scales are one vector load. Q8_0's groups make a column's
// sum one lane of the multiply-adds, so no horizontal sums.
//
// Each row of x is quantized on the fly to int8 per 32-block (a scale, the block's float sum for
// Q4_1's min term, its integer sum for Q8_0's w + 128 on VNNI), so a block's dot product is integer
// (u8 x s8 multiply-adds) and is scaled once: sum_k w_k x_k = dw * dx * sum(q * qx) + m * sum(x).
//
// The packing is quant_pack.cpp's; this file quantizes activations and multiplies, a tile at a time, or on
// AVX512-VNNI two tiles at a time for 4 rows or more (quant_tiles.h: the same bits, half the instructions).
#include "common/ops.h"
#include "common/prefetch.h"
#include "gemm/quant_format.h"
#include "gemm/quant_tiles.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvserve {
namespace {

using namespace quant;

// ---- activations -----------------------------------------------------------------------------

inline void quantize_block(const float* v, int8_t* q, float* d, float* s, int32_t* qsum) {
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 x[4], amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, x[i]));
    sum = _mm256_add_ps(sum, x[i]);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
  const float mx = _mm_cvtss_f32(m4);
  const __m256 inv = _mm256_set1_ps(mx > 0.f ? 127.f / mx : 0.f);
  __m256i i32[4];
  for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], inv));  // round to nearest even
  const __m256i t8 = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t8), _mm256_extracti128_si256(t8, 1));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
  *qsum = _mm_cvtsi128_si32(t4);
  // pack to int8; packs works per 128-bit lane, so restore the order with one permute
  const __m256i i16 = _mm256_packs_epi32(i32[0], i32[1]), j16 = _mm256_packs_epi32(i32[2], i32[3]);
  const __m256i i8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i16, j16), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), i8);
  *d = mx / 127.f;
  *s = _mm_cvtss_f32(s4);
#else
  float amax = 0.f, sum = 0.f;
  for (int k = 0; k < QK; ++k) {
    amax = std::max(amax, std::fabs(v[k]));
    sum += v[k];
  }
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t total = 0;
  for (int k = 0; k < QK; ++k) total += q[k] = static_cast<int8_t>(std::nearbyint(v[k] * inv));
  *qsum = total;
  *d = amax / 127.f;
  *s = sum;
#endif
}

// ---- the kernels: one tile of 8 columns for MR rows --------------------------------------------


inline void store_row(float* dst, const float* src, int64_t cols) {
  for (int64_t j = 0; j < cols; ++j) dst[j] = src[j];
}

#if defined(__AVX2__)
#if defined(__AVXVNNI__)
#define KV_VNNI 1
#define VNNI_DPBUSD _mm256_dpbusd_avx_epi32
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KV_VNNI 1
#define VNNI_DPBUSD _mm256_dpbusd_epi32
#else
#define KV_VNNI 0
#endif

// Ends what the compiler may assume about v, at no cost: a chain of adds then stays a chain. Left free,
// GCC rebalances a block's adds into a tree, which needs every product live at once and, in AVX2's
// 16 registers, spills them to the stack.
inline __m256i opaque(__m256i v) {
  asm("" : "+x"(v));
  return v;
}

// Q4's 8 column totals of one block for one row, as [c0 c1 c2 c3 | c4 c5 c6 c7]: lo[k] / hi[k] hold columns
// k (low 128 bits) and k + 4 (high) as nibbles for x's first / second 16 values, xl / xh.
inline __m256i q4_column_sums(const __m256i (&lo)[4], const __m256i (&hi)[4], __m256i xl, __m256i xh) {
#if KV_VNNI
  __m256i p[4];
  for (int k = 0; k < 4; ++k) p[k] = VNNI_DPBUSD(VNNI_DPBUSD(_mm256_setzero_si256(), lo[k], xl), hi[k], xh);
  // per 128-bit lane hadds: the columns in order
  return _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
#else
  // maddubs saturates its pairwise i16 sums, but Q4's never get there: a pair is at most 2 * 15 * 127,
  // and 8 of them summed in 16 bits stay under 2^15. So the 16-bit partials are folded by unpack + add
  // (hadd is several uops: 1.4x slower here on Zen 3) down to 2 per column, and widened once.
  __m256i s[4];
  for (int k = 0; k < 4; ++k) s[k] = _mm256_add_epi16(_mm256_maddubs_epi16(lo[k], xl), _mm256_maddubs_epi16(hi[k], xh));
  // per 128-bit lane, 16-bit: [k k k k k k k k] x 4 -> [0 0 1 1 0 0 1 1], [2 2 3 3 2 2 3 3] -> [0 0 1 1 2 2 3 3]
  const __m256i s01 = _mm256_add_epi16(_mm256_unpacklo_epi32(s[0], s[1]), _mm256_unpackhi_epi32(s[0], s[1]));
  const __m256i s23 = _mm256_add_epi16(_mm256_unpacklo_epi32(s[2], s[3]), _mm256_unpackhi_epi32(s[2], s[3]));
  const __m256i pairs = _mm256_add_epi16(_mm256_unpacklo_epi64(s01, s23), _mm256_unpackhi_epi64(s01, s23));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

// The MR rows of a tile's 8 sums into y (fewer columns in a last, partial tile).
template <int MR>
inline void store_tile(const __m256 (&acc)[MR], const TileArgs& t) {
  for (int i = 0; i < MR; ++i) {
    if (t.cols == NR) {
      _mm256_storeu_ps(t.y + i * t.ldy, acc[i]);
    } else {
      alignas(32) float tmp[NR];
      _mm256_store_ps(tmp, acc[i]);
      store_row(t.y + i * t.ldy, tmp, t.cols);
    }
  }
}


// MIN: Q4_1, w = d q + m; else Q4_0, w = d (q - 8), whose -8 sum(x) is the integer block sum of x
template <int MR, bool MIN>
void q4_tile(const TileArgs& t) {
  constexpr int64_t block_bytes = block_bytes_of(MIN ? kQ4_1 : kQ4_0);
  const QuantizedRows& a = *t.a;
  const int64_t nb = a.nb;
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = t.tile + b * block_bytes;
    t.pf->upto(blk + block_bytes);
    // 32 bytes k = column k's 16 bytes, then column k + 4's: low nibbles are elements 0..15 of both
    // columns, high nibbles 16..31, so each is one multiply-add against x's half broadcast twice,
    // and lane 0 (1) of the product holds column k's (k + 4's) partial sums.
    __m256i lo[4], hi[4];
    for (int k = 0; k < 4; ++k) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * k));
      lo[k] = _mm256_and_si256(v, mask);
      hi[k] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 128)));
    __m256 mw = _mm256_setzero_ps();
    if constexpr (MIN) mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 144)));
    for (int i = 0; i < MR; ++i) {
      const int64_t row = t.row0 + i;
      const int8_t* xq = a.q.data() + row * a.K + b * QK;
      const __m256i xl = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq)));
      const __m256i xh = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + 16)));
      __m256i sums = q4_column_sums(lo, hi, xl, xh);
      if constexpr (!MIN) sums = _mm256_sub_epi32(sums, _mm256_set1_epi32(8 * a.qsum[row * nb + b]));
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.d[row * nb + b]));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[i]);
      if constexpr (MIN) acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[row * nb + b]), acc[i]);
    }
  }
  store_tile<MR>(acc, t);
}

template <int MR>
void q8_tile(const TileArgs& t) {
  const QuantizedRows& a = *t.a;
  const int64_t nb = a.nb;
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
#if KV_VNNI
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
#else
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = t.tile + b * block_bytes_of(kQ8_0);
    t.pf->upto(blk + block_bytes_of(kQ8_0));
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 256)));
    // C independent sums per row (groups g, g + C, ...): one chain of 8 dependent multiply-adds
    // per block would bound a decode step by their latency, not by its bytes. Without VNNI, several
    // rows are chains enough, and AVX2's 16 registers hold no more sums without spilling.
    constexpr int C = MR == 1 ? 4 : (KV_VNNI ? 2 : 1);
    __m256i sum[MR][C];
    const int8_t* xq[MR];
    for (int i = 0; i < MR; ++i) {
      xq[i] = a.q.data() + (t.row0 + i) * a.K + b * QK;
      for (int c = 0; c < C; ++c) sum[i][c] = _mm256_setzero_si256();
    }
    for (int g = 0; g < QK / 4; ++g) {  // group g: k = 4g..4g+3 of the 8 columns (q8_offset)
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * g));
#if KV_VNNI  // (w + 128) x as u8 x s8; 128 * sum(x) comes off below
      const __m256i wu = _mm256_xor_si256(w, bias);
#else  // maddubs wants one unsigned side: |w| x (x with w's sign)
      const __m256i wu = _mm256_sign_epi8(w, w);
#endif
      for (int i = 0; i < MR; ++i) {
        int32_t x4;
        std::memcpy(&x4, xq[i] + 4 * g, 4);
#if KV_VNNI
        sum[i][g % C] = VNNI_DPBUSD(sum[i][g % C], wu, _mm256_set1_epi32(x4));
#else
        sum[i][g % C] = opaque(_mm256_add_epi32(sum[i][g % C], _mm256_madd_epi16(_mm256_maddubs_epi16(wu, _mm256_sign_epi8(_mm256_set1_epi32(x4), w)), ones)));
#endif
      }
    }
    for (int i = 0; i < MR; ++i) {
      __m256i total = sum[i][0];
      for (int c = 1; c < C; ++c) total = _mm256_add_epi32(total, sum[i][c]);
#if KV_VNNI
      total = _mm256_sub_epi32(total, _mm256_set1_epi32(128 * a.qsum[(t.row0 + i) * nb + b]));
#endif
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.d[(t.row0 + i) * nb + b]));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), scale, acc[i]);
    }
  }
  store_tile<MR>(acc, t);
}
#endif

// Any CPU: the same sums, one column and one row at a time.
template <Fmt F, int MR>
void scalar_tile(const TileArgs& t) {
  constexpr bool Q4 = F != kQ8_0;
  const QuantizedRows& a = *t.a;
  const int64_t nb = a.nb, q_bytes = Q4 ? 16 : 32, block_bytes = block_bytes_of(F);
  for (int i = 0; i < MR; ++i) {
    const int64_t row = t.row0 + i;
    for (int64_t j = 0; j < t.cols; ++j) {
      float total = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = t.tile + b * block_bytes;
        const uint8_t* q = blk + (Q4 ? q4_column_slot(j) * q_bytes : 0);
        const uint16_t* scales = reinterpret_cast<const uint16_t*>(blk + NR * q_bytes);
        const int8_t* xq = a.q.data() + row * a.K + b * QK;
        int32_t dot = 0;
        if constexpr (Q4) {
          const int off = F == kQ4_0 ? 8 : 0;
          for (int k = 0; k < 16; ++k) dot += ((q[k] & 0x0F) - off) * xq[k] + ((q[k] >> 4) - off) * xq[k + 16];
        } else {
          for (int k = 0; k < 32; ++k) dot += static_cast<int8_t>(q[q8_offset(j, k)]) * xq[k];
        }
        total += half_to_float(scales[j]) * a.d[row * nb + b] * static_cast<float>(dot);
        if constexpr (F == kQ4_1) total += half_to_float(scales[NR + j]) * a.s[row * nb + b];
      }
      t.y[i * t.ldy + j] = total;
    }
  }
}

template <Fmt F, int MR>
inline void run_tile(const TileArgs& t) {
#if defined(__AVX2__)
  if constexpr (F == kQ8_0) q8_tile<MR>(t);
  else q4_tile<MR, F == kQ4_1>(t);
#else
  scalar_tile<F, MR>(t);
#endif
}

// One tile (8 columns), or with Pair on AVX512-VNNI two adjacent ones (16: quant_tiles.h), for MR rows.
template <Fmt F, bool Pair, int MR>
inline void run_kernel(const TileArgs& t) {
#if KV_TILE_PAIRS
  if constexpr (Pair) {
    run_pair<F, MR>(t);
    return;
  }
#endif
  run_tile<F, MR>(t);
}

// The kernel over M rows in groups of 4 (then the 1-3 left), from the tile at `args`
template <Fmt F, bool Pair>
void row_groups(int64_t M, int64_t a_row0, float* y0, int64_t N, TileArgs args) {
  for (int64_t r = 0; r < M; r += 4) {
    args.row0 = a_row0 + r, args.y = y0 + r * N;
    switch (std::min<int64_t>(4, M - r)) {
      case 4: run_kernel<F, Pair, 4>(args); break;
      case 3: run_kernel<F, Pair, 3>(args); break;
      case 2: run_kernel<F, Pair, 2>(args); break;
      default: run_kernel<F, Pair, 1>(args); break;
    }
  }
}

// Tiles [t0, t1) for every row (a's rows from a_row0): rows in groups of 4, so a block's unpacked weights serve 4 rows
// from registers; a tile's bytes (a few KB) stay in L1 across the groups.
template <Fmt F>
void tiles(const uint8_t* packed, const QuantizedRows& a, int64_t M, int64_t N, int64_t t0, int64_t t1, float* y,
           int64_t a_row0, StreamPrefetch* given) {
  constexpr int64_t block_bytes = block_bytes_of(F);
  StreamPrefetch own;  // tiles [t0, t1) are one sequential stream
  StreamPrefetch& pf = given ? *given : own;
  if (!pf.started()) pf.start(packed + t0 * a.nb * block_bytes);
  for (int64_t t = t0; t < t1; ++t) {
    const TileArgs args{packed + t * a.nb * block_bytes, &a, 0, y + t * NR, N, std::min(NR, N - t * NR), &pf};
    // rows enough to be compute-bound, and two full tiles: both at once
    if (KV_TILE_PAIRS && M >= 4 && t + 1 < t1 && (t + 2) * NR <= N) {
      row_groups<F, true>(M, a_row0, y + t * NR, N, args);
      ++t;
    } else {
      row_groups<F, false>(M, a_row0, y + t * NR, N, args);
    }
  }
}

}  // namespace

void QuantizedRows::reserve(int64_t M, int64_t K_) {
  K = K_;
  nb = K_ / QK;
  if (static_cast<int64_t>(q.size()) < M * K) q.resize(M * K);
  if (static_cast<int64_t>(d.size()) < M * nb) {
    d.resize(M * nb);
    s.resize(M * nb);
    qsum.resize(M * nb);
  }
}

void quantize_rows_range(const float* x, QuantizedRows& a, int64_t r0, int64_t r1) {
  for (int64_t i = r0 * a.nb; i < r1 * a.nb; ++i) quantize_block(x + i * QK, a.q.data() + i * QK, a.d.data() + i, a.s.data() + i, a.qsum.data() + i);
}

PackedWeight packed_weight(const at::Tensor& packed, const std::string& kind, int64_t n, int64_t k) {
  const Format f = format_of(kind);
  TORCH_CHECK(k % QK == 0, "packed_linear: K (", k, ") must be a multiple of 32");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == num_tiles(n) * (k / QK) * f.block_bytes,
              "packed_linear: packed does not hold a [", n, ", ", k, "] ", kind, " weight");
  return {packed.data_ptr<uint8_t>(), f.q4, f.min, f.block_bytes, n, k};
}

void linear_tiles_range(const PackedWeight& w, const QuantizedRows& a, int64_t M, float* y, int64_t t0, int64_t t1,
                        int64_t a_row0, StreamPrefetch* pf) {
  if (!w.q4) tiles<kQ8_0>(w.data, a, M, w.n, t0, t1, y, a_row0, pf);
  else if (w.min) tiles<kQ4_1>(w.data, a, M, w.n, t0, t1, y, a_row0, pf);
  else tiles<kQ4_0>(w.data, a, M, w.n, t0, t1, y, a_row0, pf);
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::string& kind, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "packed_linear: x must be a 2-D float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1);
  const PackedWeight w = packed_weight(packed, kind, n, K);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  // the calling thread's buffers, reused across calls (a decode step makes ~120 of these)
  thread_local QuantizedRows buffers;
  QuantizedRows& a = buffers;  // the lambdas below run on other threads: they must see this thread's
  a.reserve(M, K);
  const float* xp = xc.data_ptr<float>();
  // 64 rows of 32 blocks (64k values) per thread: smaller inputs quantize on one thread (a region costs more)
  at::parallel_for(0, M, std::max<int64_t>(1, 2048 / a.nb), [&](int64_t r0, int64_t r1) { quantize_rows_range(xp, a, r0, r1); });
  // Work is split by tiles, at least ~256 KB of weights x rows per thread: a decode's small
  // layers (M=1, a few hundred KB) run on one thread, since waking another costs more than it saves.
  const int64_t tile_bytes = packed.numel() / num_tiles(n);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (tile_bytes * M));
  float* out = y.data_ptr<float>();
  at::parallel_for(0, num_tiles(n), grain, [&](int64_t t0, int64_t t1) { linear_tiles_range(w, a, M, out, t0, t1); });
  return y;
}

}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("packed_linear(Tensor x, Tensor packed, str kind, int n) -> Tensor", &kvserve::packed_linear);
}
