// Running the paged attention kernel's work items (paged_work.h) on the calling thread: per item,
// its query rows against its sequence's K/V blocks with a streaming softmax, then its rows into out
// (or, for a part of a split decode, its softmax state into Args::partial, merged by merge_parts).
// Three paths: decodes over a bf16 cache on AMX tiles (amx_decode.h) or with bf16 pair dot products
// (bf16_dot.h), where the build has them, and float rows (paged_kernels.h) for everything else.
#include "attention/amx_decode.h"
#include "attention/bf16_dot.h"
#include "attention/paged_kernels.h"
#include "attention/paged_work.h"
#include "common/inline.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvserve {
namespace paged {
namespace {

using namespace kvserve::bf16dot;
namespace amxdecode = kvserve::amxdecode;

// Asks for rows [0, n) of K and V at element offset `base` (row stride `stride` elements, `bytes` bytes
// each) to be brought into the cache ahead of use: the blocks of a table are scattered over the pool,
// so the hardware prefetcher cannot guess the next one.
template <typename T>
inline void prefetch_block(const Args& a, int64_t base, int n, int64_t stride, int64_t bytes, const T*) {
#if defined(__AVX2__) || defined(__AVX512F__)
  const char* k = reinterpret_cast<const char*>(static_cast<const T*>(a.k) + base);
  const char* v = reinterpret_cast<const char*>(static_cast<const T*>(a.v) + base);
  const int64_t row = stride * static_cast<int64_t>(sizeof(T));
  for (int j = 0; j < n; ++j)
    for (int64_t off = 0; off < bytes; off += 64) {
      _mm_prefetch(k + j * row + off, _MM_HINT_T0);
      _mm_prefetch(v + j * row + off, _MM_HINT_T0);
    }
  // Prefetches have no effect the compiler must keep in place: GCC moved these past the work they
  // are spread over (30 layers of 64 decodes over a cold cache: 26 ms, against 15 ms with this barrier)
  asm volatile("" ::: "memory");
#endif
}

// Per-thread scratch, kept between calls: the item's query rows (fp32, pre-scaled), their
// accumulators and softmax state, and one block's scores (padded to whole vectors).
struct Scratch {
  std::vector<float> q, acc, m, l, s, kw, vw;  // kw, vw: one block of one kv head's K and V, widened
  std::vector<float> tacc, tm, tl;             // the rows' totals over the partitions folded so far
  std::vector<float> lv;                       // the bf16-dot decode path: per-lane softmax sums, 16 a row
  std::vector<uint16_t> qh, vp, pb;            // the bf16-dot path: q rows, V's row pairs, probabilities
  void fit(int64_t rows, int64_t d, int64_t bs) {
    if (static_cast<int64_t>(qh.size()) < rows * d) qh.resize(rows * d);
    if (static_cast<int64_t>(vp.size()) < (bs + 1) * d) vp.resize((bs + 1) * d), pb.resize(bs + W + 1);
    if (static_cast<int64_t>(q.size()) < rows * d) q.resize(rows * d), acc.resize(rows * d), tacc.resize(rows * d);
    if (static_cast<int64_t>(kw.size()) < bs * d) kw.resize(bs * d), vw.resize(bs * d);
    if (static_cast<int64_t>(m.size()) < rows) m.resize(rows), l.resize(rows), lv.resize(rows * 16), tm.resize(rows), tl.resize(rows);
    // a block's scores in whole vectors (from an offset of one key: attend_block), or 16 for each of
    // decode_keys_bf16's up to 4 heads
    const int64_t s_len = std::max<int64_t>((bs + W) / W * W + W, 4 * 16);
    if (static_cast<int64_t>(s.size()) < s_len) s.resize(s_len);
  }
};
thread_local Scratch tl_scratch;

// decode_keys_bf16 for gn (1..4) heads
template <int DS>
inline void decode_heads_bf16(int gn, const uint16_t* q, const BF16* k, const BF16* v, int64_t stride, int n,
                              int readable, int lo, float cap, float* m, float* lv, float* acc, float* s) {
  switch (gn) {
    case 1: decode_keys_bf16<DS, 1>(q, k, v, stride, n, readable, lo, cap, m, lv, acc, s); break;
    case 2: decode_keys_bf16<DS, 2>(q, k, v, stride, n, readable, lo, cap, m, lv, acc, s); break;
    case 3: decode_keys_bf16<DS, 3>(q, k, v, stride, n, readable, lo, cap, m, lv, acc, s); break;
    default: decode_keys_bf16<DS, 4>(q, k, v, stride, n, readable, lo, cap, m, lv, acc, s); break;
  }
}

// One item's shape, as every step of run_item reads it. kDot: a bf16 cache read with bf16 pair dot
// products (this build has AVX512-BF16, and the head size is a multiple of 32).
template <int DS, typename TKV>
struct ItemView {
  static constexpr bool kDot = kBF16Dot && std::is_same_v<TKV, BF16> && DS > 0 && DS % 32 == 0;
  const Args& a;
  const Item& it;
  const Item* next;  // the thread's next item (its first block is prefetched at the end), or null
  const int d_rt, G, bs;
  const int32_t* info;  // the sequence's row of seq_info
  const int row0, first_pos;
  const int HG;       // query heads per token: those of kv heads h0..h1, in order
  const int R;        // rows: token-major
  const int n_keys;   // keys up to the last row's position
  const int32_t* table;
  const int64_t kstride;  // from one slot's row of a head to the next slot's
  const int nh;           // kv heads
  const int per_head;     // query rows of one kv head

  ItemView(const Args& a, const Item& it, const Item* next)
      : a(a), it(it), next(next), d_rt(DS > 0 ? DS : static_cast<int>(a.d)), G(static_cast<int>(a.heads / a.kv_heads)),
        bs(static_cast<int>(a.bs)), info(a.info + 4 * it.seq), row0(info[0]), first_pos(info[2] - info[1]),
        HG((it.h1 - it.h0) * G), R((it.t1 - it.t0) * HG), n_keys(std::min(first_pos + it.t1, it.k1)),
        table(a.tables + info[3]), kstride(a.kv_heads * d_rt), nh(it.h1 - it.h0), per_head((it.t1 - it.t0) * G) {}

  int d() const { return DS > 0 ? DS : d_rt; }

  // The block after the one at key kb may be anywhere in the pool (a pool churned by many requests
  // scatters every table): fetch it while this one is used, a kv head's share of its rows before
  // each kv head's work (hh of the item's nh); on an item's last block, the first block of `next`.
  // Issued all at once, they fill the core's miss buffers while the block's own arithmetic waits:
  // 30 layers of 64 decodes over a scattered, cold bf16 cache take ~16 ms so and ~14.3 ms spread;
  // over a fresh engine's contiguous tables, the same.
  // Rows [rows * part / parts, rows * (part + 1) / parts) of the block holding key x; past this
  // item's blocks, x continues into the next item's keys.
  void prefetch_part(int x, int part, int parts) const {
    int32_t blk, rows, h0 = it.h0, heads = nh;
    if (x < n_keys) {
      blk = table[x / bs], rows = std::min(bs, n_keys - x / bs * bs);
    } else {
      if (next == nullptr) return;
      const int end = it.k0 + (n_keys - it.k0 + bs - 1) / bs * bs;  // past this item's last block
      const int32_t* ninfo = a.info + 4 * next->seq;
      const int nx = next->k0 + (x - end), nn = std::min(ninfo[2] - ninfo[1] + next->t1, next->k1);
      if (nx >= nn) return;
      rows = std::min(bs, nn - nx / bs * bs);
      blk = a.tables[ninfo[3] + nx / bs], h0 = next->h0, heads = next->h1 - next->h0;
    }
    const int j0 = rows * part / parts, j1 = rows * (part + 1) / parts;
    prefetch_block(a, static_cast<int64_t>(blk) * bs * kstride + h0 * d() + j0 * kstride, j1 - j0,
                   kstride, heads * d() * static_cast<int64_t>(sizeof(TKV)), static_cast<const TKV*>(nullptr));
  }
  // a kv head's share of the block after the one at key kb (kb on a block boundary)
  void prefetch_next(int kb, int hh) const { prefetch_part(kb + bs, hh, nh); }
};

// The item's query rows into sc.q, scaled (an 8-bit cache's K scales folded in), their accumulators
// and softmax state reset; for bf16 pair products also rounded to bf16 into sc.qh.
template <int DS, typename TQ, typename TKV>
KVSERVE_INLINE void load_queries(const ItemView<DS, TKV>& v, Scratch& sc) {
  const Args& a = v.a;
  const Item& it = v.it;
  const int d = v.d(), G = v.G, HG = v.HG, R = v.R;
  float *qb = sc.q.data(), *acc = sc.acc.data(), *m = sc.m.data(), *l = sc.l.data();
  const TQ* q = static_cast<const TQ*>(a.q);
  for (int r = 0; r < R; ++r) {
    const TQ* src = q + (v.row0 + it.t0 + r / HG) * a.q_s0 + (it.h0 * G + r % HG) * a.q_s1;
    if (a.k_scale) {  // q . (k x s) = (q x s) . k
      const float* ks = a.k_scale + (it.h0 + (r % HG) / G) * d;
      for (int i = 0; i < d; ++i) qb[r * d + i] = to_f32(src[i]) * a.scale * ks[i];
    } else {
      for (int i = 0; i < d; ++i) qb[r * d + i] = to_f32(src[i]) * a.scale;
    }
    std::fill(acc + r * d, acc + (r + 1) * d, 0.f);
    m[r] = kNegInf;
    l[r] = 0.f;
  }
  if constexpr (ItemView<DS, TKV>::kDot) {  // the scaled q rows rounded to bf16
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < d; i += W) vstore(reinterpret_cast<BF16*>(sc.qh.data()) + r * d + i, vload(qb + r * d + i));
  }
}

// A decode item on AMX tiles, where they take it (one token, up to 16 rows, head size 64): whether it ran.
template <int DS, typename TKV>
KVSERVE_INLINE bool decode_on_tiles(const ItemView<DS, TKV>& v, Scratch& sc) {
  const Args& a = v.a;
  const Item& it = v.it;
  if (!(it.t1 - it.t0 == 1 && v.R <= 16 && amxdecode::usable(true, v.d(), v.bs))) return false;
  float *lv = sc.lv.data(), *l = sc.l.data();
  std::fill(lv, lv + v.R * 16, 0.f);
  amxdecode::attend(sc.qh.data(), v.G, v.nh, static_cast<const BF16*>(a.k), static_cast<const BF16*>(a.v), v.table,
                    v.bs, v.kstride, it.h0, it.k0, v.n_keys, std::max(it.k0, a.key_start(v.first_pos + it.t0)),
                    a.softcap, sc.m.data(), lv, sc.acc.data(),
                    [&v](int x, int part, int parts) { v.prefetch_part(x, part, parts); });
  for (int r = 0; r < v.R; ++r) l[r] = sum16(lv + 16 * r);
  return true;
}

// A decode item (one token) with bf16 pair products: every head of a kv head at once, 16 keys at a time.
template <int DS, typename TKV>
KVSERVE_INLINE void decode_bf16_dot(const ItemView<DS, TKV>& v, Scratch& sc) {
  const Args& a = v.a;
  const Item& it = v.it;
  const int d = v.d(), G = v.G, bs = v.bs, n_keys = v.n_keys;
  const int64_t kstride = v.kstride;
  float *acc = sc.acc.data(), *m = sc.m.data(), *l = sc.l.data(), *s = sc.s.data(), *lv = sc.lv.data();
  std::fill(lv, lv + v.R * 16, 0.f);
  const int ws = a.key_start(v.first_pos + it.t0);  // the window's first key
  for (int kb = it.k0; kb < n_keys; kb += bs) {
    const int n = std::min(bs, n_keys - kb);  // all at or before the token's position
    const int64_t block = static_cast<int64_t>(v.table[kb / bs]) * bs * kstride;
    const int j_first = std::max(0, ws - kb) / 16 * 16;  // the first group of 16 with a key in the window
    for (int hh = 0; hh < v.nh; ++hh) {
      v.prefetch_next(kb, hh);
      const TKV* kp = static_cast<const TKV*>(a.k) + block + (it.h0 + hh) * d;
      const TKV* vp = static_cast<const TKV*>(a.v) + block + (it.h0 + hh) * d;
      for (int j0 = j_first; j0 < n; j0 += 16)
        for (int g0 = 0; g0 < G; g0 += 4) {
          const int r = hh * G + g0;
          decode_heads_bf16<DS>(std::min(4, G - g0), sc.qh.data() + r * d, kp + j0 * kstride, vp + j0 * kstride,
                                kstride, std::min(16, n - j0), std::min(16, bs - j0), std::max(0, ws - kb - j0),
                                a.softcap, m + r, lv + 16 * r, acc + r * d, s);
        }
    }
  }
  for (int r = 0; r < v.R; ++r) l[r] = sum16(lv + 16 * r);
}

// The n keys of the block at element offset `block` (key kb on) for kv head hh's query rows: their
// scores, the rows' softmax and p . v. A non-float32 cache's block rows of the kv head are widened to
// float32 once (into sc.kw / sc.vw) and read from there by every query row of that kv head: its G
// heads and the tile's tokens.
template <int DS, typename TKV>
KVSERVE_INLINE void attend_block(const ItemView<DS, TKV>& v, Scratch& sc, int kb, int n, int64_t block, int hh) {
  constexpr bool kDot = ItemView<DS, TKV>::kDot;
  constexpr bool kWiden = !std::is_same_v<TKV, float> && !kDot;
  const Args& a = v.a;
  const Item& it = v.it;
  const int d = v.d(), G = v.G, bs = v.bs;
  const int64_t kstride = v.kstride;
  float *qb = sc.q.data(), *acc = sc.acc.data(), *m = sc.m.data(), *l = sc.l.data(), *s = sc.s.data();
  v.prefetch_next(kb, hh);
  const int64_t base = block + (it.h0 + hh) * d;
  const TKV* kp = static_cast<const TKV*>(a.k) + base;
  const TKV* vp = static_cast<const TKV*>(a.v) + base;
  const float *krows, *vrows;
  int64_t fstride;
  int readable = bs;
  if constexpr (kDot) {
    pair_rows<DS>(vp, kstride, n, sc.vp.data());
    krows = vrows = nullptr, fstride = 0;
  } else if constexpr (kWiden) {
    // the whole block, so scores() groups a row's keys as it would in any other item (its rows past the
    // context are the pool's memory, read and ignored)
    widen_rows<DS>(kp, kstride, bs, d, sc.kw.data());
    widen_rows<DS>(vp, kstride, n, d, sc.vw.data());
    krows = sc.kw.data(), vrows = sc.vw.data(), fstride = d;
  } else {
    krows = kp, vrows = vp, fstride = kstride;
  }
  for (int rr = 0; rr < v.per_head; ++rr) {
    const int tt = rr / G, r = tt * v.HG + hh * G + rr % G;  // row r: token it.t0 + tt, head h0 * G + hh * G + g
    const int pos = v.first_pos + it.t0 + tt;
    const int nv = std::min(n, pos + 1 - kb);          // causal: keys <= the row's position
    const int lo = std::max(0, a.key_start(pos) - kb);  // and in its window: keys [lo, nv) of the block
    if (nv <= lo) continue;
    // the scores of keys [lo, nv) at sp; the bf16 pair products read V from an even key, lo's or the one before
    const int off = kDot ? lo % 2 : 0;
    float* sp = s + off;
    if constexpr (kDot) {
      scores_bf16<DS>(sc.qh.data() + r * d, kp + lo * kstride, kstride, nv - lo, readable - lo, sp);
    } else {
      scores<DS>(qb + r * d, krows + lo * fstride, fstride, nv - lo, readable - lo, d, sp);
    }
    if (a.softcap > 0.f) softcap_scores(sp, nv - lo, a.softcap);
    float* ar = acc + r * d;
    softmax_update(sp, nv - lo, d, m[r], l[r], ar);
    if constexpr (kDot) {
      if (off) s[0] = 0.f;  // the key before lo pairs with it: no weight
      accumulate_bf16<DS>(ar, s, sc.vp.data() + (lo - off) * DS, nv - lo + off, sc.pb.data());
    } else {
      accumulate<DS>(ar, sp, vrows + lo * fstride, fstride, nv - lo, d);
    }
  }
}

// The item's rows out: normalised into out (an 8-bit cache's V scales applied), or, for a part of a
// split decode, its rows' state into Args::partial for merge_parts.
template <int DS, typename TQ, typename TKV>
KVSERVE_INLINE void finish_item(const ItemView<DS, TKV>& v, Scratch& sc) {
  const Args& a = v.a;
  const Item& it = v.it;
  const int d = v.d(), G = v.G, HG = v.HG, R = v.R;
  float *acc = sc.acc.data(), *m = sc.m.data(), *l = sc.l.data();
  if constexpr (ItemView<DS, TKV>::kDot) {  // the sums back in the order of dims
    for (int r = 0; r < R; ++r) unpermute_bf16<DS>(acc + r * d);
  }
  if (it.part >= 0) return;  // a part of a split decode: its partitions' states are in Args::partial
  TQ* out = static_cast<TQ*>(a.out);
  for (int r = 0; r < R; ++r) {
    TQ* dst = out + (v.row0 + it.t0 + r / HG) * a.o_s0 + (it.h0 * G + r % HG) * a.o_s1;
    const float inv = softmax_inverse(m[r], l[r], a.sinks, it.h0 * G + r % HG);
    store_output(dst, acc + r * d, inv, a.v_scale ? a.v_scale + (it.h0 + (r % HG) / G) * d : nullptr, d);
  }
}

// The rows' state over the partition ending now (partition `local` of the item, counted from its first):
// for a part of a split decode, left in Args::partial for merge_parts; else folded into the rows' totals,
// or, for the item's last partition, the totals folded into it (the rows' final state, for finish_item).
// Then, but for the last, reset for the next partition.
template <int DS, typename TKV>
[[gnu::noinline]] void close_partition(const ItemView<DS, TKV>& v, Scratch& sc, int local, bool last) {
  const int d = v.d();
  float *acc = sc.acc.data(), *m = sc.m.data(), *l = sc.l.data();
  if (v.it.part < 0) fold_rows(v.R, sc.tm.data(), sc.tl.data(), sc.tacc.data(), m, l, acc, d, last);
  for (int r = 0; r < v.R; ++r) {
    if (v.it.part >= 0) {
      if constexpr (ItemView<DS, TKV>::kDot) unpermute_bf16<DS>(acc + r * d);  // partial rows are in dim order
      float* p = v.a.partial + (v.it.part + static_cast<int64_t>(local) * v.a.heads + r) * (d + 2);
      std::copy(acc + r * d, acc + (r + 1) * d, p);
      p[d] = m[r];
      p[d + 1] = l[r];
    }
    if (last && v.it.part < 0) continue;
    std::fill(acc + r * d, acc + (r + 1) * d, 0.f);
    m[r] = kNegInf;
    l[r] = 0.f;
  }
}

// A decode shortcut's whole-range state as a split part's: its first partition's row, the others empty.
template <int DS, typename TKV>
void emit_whole(const ItemView<DS, TKV>& v, Scratch& sc) {
  const int pk = v.a.part_keys, locals = (v.n_keys - 1) / pk - v.it.k0 / pk + 1;
  for (int local = 0; local < locals; ++local) close_partition(v, sc, local, false);  // past the first: empty
}

template <int DS, typename TQ, typename TKV>
void run_item(const Args& a, const Item& it, Scratch& sc, const Item* next) {
  using View = ItemView<DS, TKV>;
  const View v(a, it, next);
  load_queries<DS, TQ>(v, sc);
  bool done = false;
  if constexpr (View::kDot && amxdecode::kAmxDecode && DS == 64) done = !a.invariant && decode_on_tiles(v, sc);
  if constexpr (View::kDot) {
    if (it.t1 - it.t0 == 1 && !done && !a.invariant) {
      decode_bf16_dot(v, sc);
      done = true;
    }
  }
  if (done) {
    if (it.part >= 0) emit_whole(v, sc);
    finish_item<DS, TQ>(v, sc);
    return;
  }
  std::fill(sc.tm.begin(), sc.tm.begin() + v.R, kNegInf);
  std::fill(sc.tl.begin(), sc.tl.begin() + v.R, 0.f);
  const int pk = a.part_keys, first = it.k0 / pk;
  int boundary = (first + 1) * pk, local = 0;  // where the current partition ends, and its index in the item
  for (int kb = it.k0; kb < v.n_keys; kb += v.bs) {
    if (kb == boundary) {
      close_partition(v, sc, local++, false);
      boundary += pk;
    }
    const int n = std::min(v.bs, v.n_keys - kb);
    const int64_t block = static_cast<int64_t>(v.table[kb / v.bs]) * v.bs * v.kstride;
    for (int hh = 0; hh < v.nh; ++hh) attend_block(v, sc, kb, n, block, hh);
  }
  close_partition(v, sc, local, true);
  finish_item<DS, TQ>(v, sc);
}

// One query head of a split decode: its partitions' states (acc_p, m_p, l_p) folded in key order, as an
// unsplit decode folds them (fold_rows), into partition 0's row, then normalised into out.
template <typename TQ>
void merge_parts(const Args& a, const Split& sp, int64_t h) {
  const int64_t d = a.d, pstride = a.heads * (d + 2);  // from one partition's row of head h to the next one's
  float* r0 = a.partial + (sp.base + h) * (d + 2);
  float m = r0[d], l = r0[d + 1];
  for (int p = 1; p < sp.partitions; ++p) {
    float* rp = r0 + p * pstride;
    fold_rows(1, &m, &l, r0, rp + d, rp + d + 1, rp, d);
  }
  TQ* dst = static_cast<TQ*>(a.out) + a.info[4 * sp.seq] * a.o_s0 + h * a.o_s1;
  const float inv = softmax_inverse(m, l, a.sinks, h);
  const float* vs = a.v_scale ? a.v_scale + h / (a.heads / a.kv_heads) * d : nullptr;
  store_output(dst, r0, inv, vs, d);
}

// Items [i0, i1) on the calling thread.
template <int DS, typename TQ, typename TKV>
void run_items(const Args& a, const std::vector<Item>& items, int64_t i0, int64_t i1) {
  Scratch& sc = tl_scratch;
  sc.fit(std::max<int64_t>(kTile, a.kv_heads) * (a.heads / a.kv_heads), a.d, a.bs);
  const bool tiles = !a.invariant && amxdecode::usable(std::is_same_v<TKV, BF16>, a.d, a.bs);
  if (tiles) amxdecode::configure();  // decode items run on AMX tiles (amx_decode.h)
  for (int64_t i = i0; i < i1; ++i) run_item<DS, TQ, TKV>(a, items[i], sc, i + 1 < i1 ? &items[i + 1] : nullptr);
  if (tiles) amxdecode::release();
}

template <typename TQ, typename TKV>
RunItems run_items_for(int64_t d) {
  if (d == 64) return &run_items<64, TQ, TKV>;  // the common head sizes, unrolled
  if (d == 128) return &run_items<128, TQ, TKV>;
  return &run_items<0, TQ, TKV>;
}

template <typename TQ>
RunItems run_items_for_kv(at::ScalarType kv, int64_t d) {
  switch (kv) {
    case at::kFloat: return run_items_for<TQ, float>(d);
    case at::kBFloat16: return run_items_for<TQ, BF16>(d);
    case at::kChar: return run_items_for<TQ, int8_t>(d);
    case at::kFloat8_e4m3fn: return run_items_for<TQ, FP8E4M3>(d);
    default: return run_items_for<TQ, FP8E5M2>(d);
  }
}

}  // namespace

RunItems items_runner(bool q_f32, at::ScalarType kv, int64_t d) {
  return q_f32 ? run_items_for_kv<float>(kv, d) : run_items_for_kv<BF16>(kv, d);
}

MergeParts parts_merger(bool q_f32) { return q_f32 ? &merge_parts<float> : &merge_parts<BF16>; }

}  // namespace paged
}  // namespace kvserve
