// What quant_gemm.cpp's tile kernels take (TileArgs), and its AVX512-VNNI kernels over a pair of adjacent
// full tiles at once: 16 output columns in one 512-bit register, tile A's 8 in the low half, tile B's in the
// high half, read as two 256-bit halves from their own blocks. They compute the same integer block sums
// (exact) and the same float operations per column in the same order as the 8-column kernels, so a row's
// result has the same bits whichever kernel ran; but half the multiply-add instructions per column, which
// is what a prefill's rows (compute-bound) are limited by. quant_gemm.cpp runs them for 4 rows or more.
#pragma once
#include "common/ops.h"
#include "common/prefetch.h"
#include "gemm/quant_format.h"

#include <cstring>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define KV_TILE_PAIRS 1
#else
#define KV_TILE_PAIRS 0
#endif

namespace kvserve {
namespace quant {

struct TileArgs {
  const uint8_t* tile;  // the tile's first block
  const QuantizedRows* a;
  int64_t row0;         // first row
  float* y;             // y[row0, first column of the tile]
  int64_t ldy;          // row stride of y
  int64_t cols;         // valid columns in the tile (8 except in a last, partial one)
  StreamPrefetch* pf;   // the thread's stream of tiles
};

#if KV_TILE_PAIRS
// tile A's 32 bytes at a, tile B's at b
inline __m512i pair_bytes(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

// tile A's 8 fp16 scales at a, tile B's at b, as 16 floats
inline __m512 pair_scales(const uint8_t* a, const uint8_t* b) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo),
                                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}

// Per 128-bit lane, the totals of p0..p3's 4 lanes each, in order: what two rounds of hadd give on 256 bits.
inline __m512i lane_totals(__m512i p0, __m512i p1, __m512i p2, __m512i p3) {
  const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(p0, p1), _mm512_unpackhi_epi32(p0, p1));
  const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(p2, p3), _mm512_unpackhi_epi32(p2, p3));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
}

template <int MR>
inline void store_pair(const __m512 (&acc)[MR], const TileArgs& t) {
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(t.y + i * t.ldy, acc[i]);  // 16 columns, tiles A and B
}

// Q8_0 over tiles A (t.tile) and B (the next): as q8_tile, on 16 columns.
template <int MR>
void q8_pair(const TileArgs& t) {
  constexpr int64_t bb = block_bytes_of(kQ8_0);
  const QuantizedRows& a = *t.a;
  const int64_t nb = a.nb;
  const uint8_t* tile_b = t.tile + nb * bb;
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *ba = t.tile + b * bb, *bq = tile_b + b * bb;
    t.pf->upto(bq + bb);
    const __m512 dw = pair_scales(ba + 256, bq + 256);
    constexpr int C = 2;
    __m512i sum[MR][C];
    const int8_t* xq[MR];
    for (int i = 0; i < MR; ++i) {
      xq[i] = a.q.data() + (t.row0 + i) * a.K + b * QK;
      for (int c = 0; c < C; ++c) sum[i][c] = _mm512_setzero_si512();
    }
    for (int g = 0; g < QK / 4; ++g) {
      const __m512i wu = _mm512_xor_si512(pair_bytes(ba + 32 * g, bq + 32 * g), bias);
      for (int i = 0; i < MR; ++i) {
        int32_t x4;
        std::memcpy(&x4, xq[i] + 4 * g, 4);
        sum[i][g % C] = _mm512_dpbusd_epi32(sum[i][g % C], wu, _mm512_set1_epi32(x4));
      }
    }
    for (int i = 0; i < MR; ++i) {
      __m512i total = _mm512_add_epi32(sum[i][0], sum[i][1]);
      total = _mm512_sub_epi32(total, _mm512_set1_epi32(128 * a.qsum[(t.row0 + i) * nb + b]));
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[(t.row0 + i) * nb + b]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), scale, acc[i]);
    }
  }
  store_pair<MR>(acc, t);
}

// Q4_1 (MIN) or Q4_0 over tiles A and B: as q4_tile, on 16 columns.
template <int MR, bool MIN>
void q4_pair(const TileArgs& t) {
  constexpr int64_t bb = block_bytes_of(MIN ? kQ4_1 : kQ4_0);
  const QuantizedRows& a = *t.a;
  const int64_t nb = a.nb;
  const uint8_t* tile_b = t.tile + nb * bb;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *ba = t.tile + b * bb, *bq = tile_b + b * bb;
    t.pf->upto(bq + bb);
    __m512i lo[4], hi[4];
    for (int k = 0; k < 4; ++k) {
      const __m512i v = pair_bytes(ba + 32 * k, bq + 32 * k);
      lo[k] = _mm512_and_si512(v, mask);
      hi[k] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    }
    const __m512 dw = pair_scales(ba + 128, bq + 128);
    __m512 mw = _mm512_setzero_ps();
    if constexpr (MIN) mw = pair_scales(ba + 144, bq + 144);
    for (int i = 0; i < MR; ++i) {
      const int64_t row = t.row0 + i;
      const int8_t* xq = a.q.data() + row * a.K + b * QK;
      const __m512i xl = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq)));
      const __m512i xh = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + 16)));
      __m512i p[4];
      for (int k = 0; k < 4; ++k)
        p[k] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[k], xl), hi[k], xh);
      __m512i sums = lane_totals(p[0], p[1], p[2], p[3]);
      if constexpr (!MIN) sums = _mm512_sub_epi32(sums, _mm512_set1_epi32(8 * a.qsum[row * nb + b]));
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[row * nb + b]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[i]);
      if constexpr (MIN) acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[row * nb + b]), acc[i]);
    }
  }
  store_pair<MR>(acc, t);
}

template <Fmt F, int MR>
inline void run_pair(const TileArgs& t) {
  if constexpr (F == kQ8_0) q8_pair<MR>(t);
  else q4_pair<MR, F == kQ4_1>(t);
}
#endif

}  // namespace quant
}  // namespace kvserve
