// Decode attention over a bf16 KV cache on AMX tiles, for paged_items.cpp: one token's query
// heads of a few kv heads (up to 16 rows), 32 keys at a time.
//
// On AVX512-BF16 alone, q . k costs a horizontal sum per key and head, and p . v a dot product per
// pair of keys, head and 16 dims: with the softmax, a 64-sequence decode step of the embedded model
// spends ~7.5 ms of its ~15 ms attention computing, and the rest waiting on the cache's bytes (the
// two add up: measured, they do not overlap). The tiles do both products as matrix products:
//   q . k: S^T [16 keys x 16 rows] = K [16 keys x 32 dims] . Q^T [32 dims x 16 rows], K tiles loaded
//          straight from the cache (a block's rows are 16 slot rows kstride apart); Q^T holds only
//          the rows of one kv head and zeros, so the kv heads' products add into one tile;
//   p . v: O [16 rows x 16 dims] += P [16 rows x 32 keys] . V [32 keys x 16 dims], P's rows again
//          split by kv head, V's row pairs interleaved as the tiles read them (pair_rows' order: the
//          dims come out permuted, as on the AVX512-BF16 path, and unpermute_bf16 puts them back).
// The softmax runs on the rows after a 16 x 16 transpose. O stays in the tiles across steps: a
// row's max moves only when a step's scores pass it by more than kSlack (exp(kSlack) fits bf16 and
// float sums easily), so the rescaling store and reload of O happens about once per sequence.
#pragma once
#include "common/amx_tiles.h"
#include "attention/bf16_dot.h"
#include "common/inline.h"

#include <cmath>
#include <cstring>
#include <vector>

namespace kvserve {
namespace amxdecode {

using vec::BF16;
using amx::configure;
using amx::ready;
using amx::release;

#if defined(KVSERVE_AMX_TILES)
constexpr bool kAmxDecode = true;
constexpr float kSlack = 8.f;

// Tiles (amx_tiles.h): 0 and 3 S^T of a step's two key groups (then 3 is P), 1 K (or a V pair
// block), 2 Q^T, 4-7 O by 16 dims.

// r[0..16) as the rows of a 16 x 16 matrix, transposed in place
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}

// Per-thread buffers the tiles load from and store to, 64-byte rows.
struct Scratch {
  alignas(64) float st[2][16][16];  // S^T of a step's two 16-key groups
  alignas(64) float o[4][16][16];   // O, stored when rows are rescaled
  std::vector<__m512i> qt, p, v;    // per kv head: Q^T (2 tiles), P (1), V pairs (4)
  void fit(int nh) {
    if (static_cast<int>(p.size()) < nh * 16) qt.resize(nh * 32), p.resize(nh * 16), v.resize(nh * 64);
  }
};
inline thread_local Scratch tl_scratch;

constexpr int kD = 64;  // the head size the tiles take

// Q^T by kv head: tile (hh, c) row i holds dims (32 c + 2 i, + 1) of the rows of kv head hh (of the R
// rows of q, G a kv head), zeros elsewhere
KVSERVE_INLINE void load_qt(const uint16_t* q, int R, int G, int nh, __m512i* qt) {
  __m512 rows[16];
  for (int c = 0; c < 2; ++c) {
    for (int r = 0; r < 16; ++r)
      rows[r] = r < R ? _mm512_castsi512_ps(_mm512_loadu_si512(q + r * kD + 32 * c)) : _mm512_setzero_ps();
    transpose16(rows);
    for (int hh = 0; hh < nh; ++hh) {
      const __mmask16 own = static_cast<__mmask16>(((1u << G) - 1) << (hh * G));
      for (int i = 0; i < 16; ++i) qt[(hh * 2 + c) * 16 + i] = _mm512_castps_si512(_mm512_maskz_mov_ps(own, rows[i]));
    }
  }
}

KVSERVE_INLINE void zero_o() {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
}

// O's tiles added into acc, each of the R rows then scaled by alpha[r] (as lv is), and the tiles zeroed
KVSERVE_INLINE void fold_o(Scratch& sc, int R, float* acc, float* lv, const float* alpha) {
  _tile_stored(4, sc.o[0], 64);
  _tile_stored(5, sc.o[1], 64);
  _tile_stored(6, sc.o[2], 64);
  _tile_stored(7, sc.o[3], 64);
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int z = 0; z < 4; ++z)
      _mm512_storeu_ps(acc + r * kD + 16 * z,
                       _mm512_mul_ps(_mm512_add_ps(_mm512_loadu_ps(acc + r * kD + 16 * z), _mm512_loadu_ps(sc.o[z][r])), a));
    _mm512_storeu_ps(lv + 16 * r, _mm512_mul_ps(_mm512_loadu_ps(lv + 16 * r), a));
  }
  zero_o();
}

// One step's keys (up to 32 from kb, in `groups` groups of 16 whose rows start at kg[g] and vg[g])
struct StepKeys {
  int kb, n, groups;
  const BF16 *kg[2], *vg[2];
};

// S^T of each group of 16 keys into sc.st, every kv head's product into one tile
KVSERVE_INLINE void score_tiles(const StepKeys& st, const __m512i* qt, int nh, int64_t row_bytes, Scratch& sc) {
  _tile_zero(0);
  _tile_zero(3);
  for (int hh = 0; hh < nh; ++hh)
    for (int c = 0; c < 2; ++c) {
      _tile_loadd(2, qt + (hh * 2 + c) * 16, 64);
      _tile_loadd(1, st.kg[0] + hh * kD + 32 * c, row_bytes);
      _tile_dpbf16ps(0, 1, 2);
      if (st.groups == 2) {
        _tile_loadd(1, st.kg[1] + hh * kD + 32 * c, row_bytes);
        _tile_dpbf16ps(3, 1, 2);
      }
    }
  _tile_stored(0, sc.st[0], 64);
  if (st.groups == 2) _tile_stored(3, sc.st[1], 64);
}

// V's row pairs for the tiles, the keys past n as zeros (P is zero there, and 0 x NaN is not)
KVSERVE_INLINE void pair_v(const StepKeys& st, int nh, int64_t kstride, __m512i* vt) {
  for (int hh = 0; hh < nh; ++hh) {
    __m512i* out = vt + hh * 64;
    for (int i = 0; i < 16; ++i) {
      const int j = 2 * i;
      const BF16* a = st.vg[j / 16] + (j % 16) * kstride + hh * kD;
      for (int c = 0; c < 2; ++c) {
        const __m512i x = j < st.n ? _mm512_loadu_si512(a + 32 * c) : _mm512_setzero_si512();
        const __m512i y = j + 1 < st.n ? _mm512_loadu_si512(a + kstride + 32 * c) : _mm512_setzero_si512();
        out[(2 * c) * 16 + i] = _mm512_unpacklo_epi16(x, y);
        out[(2 * c + 1) * 16 + i] = _mm512_unpackhi_epi16(x, y);
      }
    }
  }
}

// the scores by row: s[g][r] holds row r's scores of group g's 16 keys (capped where cap > 0; -inf
// past the step's keys and before lo_key)
KVSERVE_INLINE void scores_by_row(const StepKeys& st, const Scratch& sc, int R, int lo_key, float cap,
                                  __m512 (&s)[2][16]) {
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  for (int g = 0; g < 2; ++g) {
    const int valid = std::min(16, std::max(0, st.n - 16 * g));
    const int before = std::min(16, std::max(0, lo_key - st.kb - 16 * g));  // keys before the window
    const __mmask16 keep = static_cast<__mmask16>(((1u << valid) - 1) & ~((1u << before) - 1));
    if (keep == 0) {
      for (int r = 0; r < 16; ++r) s[g][r] = neg_inf;
      continue;
    }
    for (int j = 0; j < 16; ++j) s[g][j] = _mm512_loadu_ps(sc.st[g][j]);
    transpose16(s[g]);
    if (cap > 0.f) {
      const __m512 c = _mm512_set1_ps(cap), inv = _mm512_set1_ps(1.f / cap);
      for (int r = 0; r < R; ++r) s[g][r] = _mm512_mul_ps(c, vec::vtanh(_mm512_mul_ps(s[g][r], inv)));
    }
    for (int r = 0; r < R; ++r) s[g][r] = _mm512_mask_blend_ps(keep, neg_inf, s[g][r]);
  }
}

// rows whose max moves past m + kSlack take it, alpha[r] their rescaling (1 for the others): whether any moved
KVSERVE_INLINE bool move_maxima(const __m512 (&s)[2][16], int R, float* m, float* alpha) {
  bool moved = false;
  for (int r = 0; r < R; ++r) {
    const float bm = _mm512_reduce_max_ps(_mm512_max_ps(s[0][r], s[1][r]));
    alpha[r] = 1.f;
    if (bm > m[r] + kSlack) {
      alpha[r] = m[r] == -__builtin_inff() ? 0.f : std::exp(m[r] - bm);
      m[r] = bm;
      moved = true;
    }
  }
  return moved;
}

// p = exp(s - m), summed per lane into lv, and as bf16 into row r of its kv head's P
KVSERVE_INLINE void probabilities(const __m512 (&s)[2][16], int R, int G, const float* m, float* lv, __m512i* pt) {
  for (int r = 0; r < R; ++r) {
    const __m512 mr = _mm512_set1_ps(m[r]);
    const __m512 p0 = vec::vexp_for_bf16(_mm512_sub_ps(s[0][r], mr));
    const __m512 p1 = vec::vexp_for_bf16(_mm512_sub_ps(s[1][r], mr));
    _mm512_storeu_ps(lv + 16 * r, _mm512_add_ps(_mm512_loadu_ps(lv + 16 * r), _mm512_add_ps(p0, p1)));
    pt[(r / G) * 16 + r] = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
  }
}

// O += P . V, kv head by kv head
KVSERVE_INLINE void pv_products(const __m512i* pt, const __m512i* vt, int nh) {
  for (int hh = 0; hh < nh; ++hh) {
    _tile_loadd(3, pt + hh * 16, 64);
    _tile_loadd(1, vt + hh * 64, 64);
    _tile_dpbf16ps(4, 3, 1);
    _tile_loadd(1, vt + hh * 64 + 16, 64);
    _tile_dpbf16ps(5, 3, 1);
    _tile_loadd(1, vt + hh * 64 + 32, 64);
    _tile_dpbf16ps(6, 3, 1);
    _tile_loadd(1, vt + hh * 64 + 48, 64);
    _tile_dpbf16ps(7, 3, 1);
  }
}

// the step from key kb: its keys' rows of kv heads h0.. in the caches, by group of 16
KVSERVE_INLINE StepKeys step_keys(int kb, int n_keys, const BF16* k_cache, const BF16* v_cache, const int32_t* table,
                                  int bs, int64_t kstride, int h0) {
  StepKeys st{kb, std::min(32, n_keys - kb), 0, {k_cache, k_cache}, {v_cache, v_cache}};
  st.groups = (st.n + 15) / 16;
  for (int g = 0; g < st.groups; ++g) {
    const int key = kb + 16 * g;
    const int64_t slot = static_cast<int64_t>(table[key / bs]) * bs + key % bs;
    st.kg[g] = k_cache + slot * kstride + h0 * kD;
    st.vg[g] = v_cache + slot * kstride + h0 * kD;
  }
  return st;
}

// One decode token's attention over keys [k0, n_keys) (k0 on a block boundary) of kv heads
// [h0, h0 + nh), G query rows each (R = nh G <= 16, head dim 64, block size a multiple of 16):
// q: its R rows, pre-scaled, bf16 [R, 64]; m, lv, acc: its rows' running max, per-lane sums of the
// exps (16 a row) and sums of p v (pair_rows' dim order), all relative to m, updated in place (m -inf,
// lv and acc 0 to start). prefetch(x, part, parts): asks for that part of the block holding key x
// (past n_keys: of the thread's next item). Keys before lo_key (a sliding window's start, in [k0,
// n_keys)) are masked, and the steps wholly before it skipped; cap > 0: the scores' soft cap.
template <class Prefetch>
void attend(const uint16_t* q, int G, int nh, const BF16* k_cache, const BF16* v_cache, const int32_t* table, int bs,
            int64_t kstride, int h0, int k0, int n_keys, int lo_key, float cap, float* m, float* lv, float* acc,
            Prefetch&& prefetch) {
  const int R = nh * G;
  Scratch& sc = tl_scratch;
  sc.fit(nh);
  __m512i *qt = sc.qt.data(), *pt = sc.p.data(), *vt = sc.v.data();
  load_qt(q, R, G, nh, qt);
  std::memset(pt, 0, nh * 16 * sizeof(__m512i));  // P's rows of other kv heads stay zero
  zero_o();
  const int64_t row_bytes = kstride * static_cast<int64_t>(sizeof(BF16));
  // from the step holding lo_key: every step has a key to see (a row's max starts finite)
  for (int kb = k0 + (lo_key - k0) / 32 * 32; kb < n_keys; kb += 32) {
    const StepKeys st = step_keys(kb, n_keys, k_cache, v_cache, table, bs, kstride, h0);
    // the next step's keys, a sixth before each stage of this one's work: issued at once, the
    // requests past the core's miss buffers stall it until earlier ones arrive, so they are spread
    auto fetch_ahead = [&](int stage) { prefetch(kb + 32 + 16 * (stage / 3), stage % 3, 3); };
    fetch_ahead(0);
    score_tiles(st, qt, nh, row_bytes, sc);
    fetch_ahead(1);
    pair_v(st, nh, kstride, vt);
    fetch_ahead(2);
    __m512 s[2][16];
    scores_by_row(st, sc, R, lo_key, cap, s);
    fetch_ahead(3);
    float alpha[16];  // rows whose max moves: O (tiles and acc) and lv rescaled to it
    if (move_maxima(s, R, m, alpha)) fold_o(sc, R, acc, lv, alpha);
    fetch_ahead(4);
    probabilities(s, R, G, m, lv, pt);
    fetch_ahead(5);
    pv_products(pt, vt, nh);
  }
  static constexpr float kOnes[16] = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f};
  fold_o(sc, R, acc, lv, kOnes);  // x 1 is exact: acc += O
}
#else
constexpr bool kAmxDecode = false;
template <class Prefetch>
void attend(const uint16_t*, int, int, const BF16*, const BF16*, const int32_t*, int, int64_t, int, int, int, int, float,
            float*, float*, float*, Prefetch&&) {}
#endif

// Whether a call's decodes run here: a bf16 cache, head size 64, blocks of whole 16-key groups, and
// the tile state granted
inline bool usable(bool bf16_cache, int64_t d, int64_t block_size) {
  return kAmxDecode && bf16_cache && d == 64 && block_size % 16 == 0 && ready();
}

}  // namespace amxdecode
}  // namespace kvserve
