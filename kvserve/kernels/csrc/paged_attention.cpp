// kvserve::paged_attention: causal attention for a flat ragged batch of query rows, reading each
// sequence's K/V in place through its block table (no gather), with a streaming softmax in fp32.
//
//   out, q:        [T, heads, d]            (float32 or bfloat16; out written for the listed rows only)
//   k/v_cache:     [slots, kv_heads, d]     (float32, bfloat16, or 8-bit: int8, fp8 e4m3 / e5m2),
//                                           slot = block * block_size + offset
//   k/v_scale:     float32 [kv_heads, d]    an 8-bit cache's scales (stored value x scale = value); the
//                                           K scales are folded into the query, the V scales into the
//                                           output, so the inner loops read the stored values as they are
//   block_tables:  int32 [N]                every sequence's blocks, one table after another
//   seq_info:      int32 [S, 4]             (first q row, q rows, context length incl. them, table offset)
//
// Query row i of sequence s sits at position ctx - n + i and attends to keys 0..that position, or,
// with a sliding window w > 0, to the w keys ending there. A window's blocks before the start of its
// sequence's earliest row's window are neither read nor looked up in the table (their entries may be
// placeholders), so a long context costs the window. A soft cap c > 0 turns each scaled score s into
// c tanh(s / c) before the softmax (Gemma 2).
// Work items are (sequence, kv heads, tile of query tokens): all the GQA heads of their kv heads and
// up to kTile tokens share each pass over a K/V block, so each K/V row is read once per item.
// Items are cut into per-thread chunks of equal estimated cost, so a few long contexts among
// many short ones do not leave threads idle. A decode that is a large share of the call (few
// sequences, long context) is also split along its keys into parts run as separate items, whose
// softmax states are merged afterwards (flash-decoding; see paged_attention()).
#include "amx_decode.h"
#include "bf16_dot.h"
#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kTile = 16;  // query tokens per work item (multi-token rows)
constexpr int kMinPartKeys = 64;  // a split decode's parts have at least this many keys
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using namespace kvserve::vec;
using namespace kvserve::bf16dot;
namespace amxdecode = kvserve::amxdecode;

template <typename T>
inline float to_f32(T x) { return static_cast<float>(x); }

// a . b over d floats
template <int DS, typename T>
inline float dot(const float* a, const T* b, int d_rt) {
  const int d = DS > 0 ? DS : d_rt;
  vf s0 = vzero(), s1 = vzero();
  int i = 0;
  for (; i + 2 * W <= d; i += 2 * W) {
    s0 = vfma(vload(a + i), vload(b + i), s0);
    s1 = vfma(vload(a + i + W), vload(b + i + W), s1);
  }
  for (; i + W <= d; i += W) s0 = vfma(vload(a + i), vload(b + i), s0);
  float sum = vsum(vadd(s0, s1));
  for (; i < d; ++i) sum += a[i] * to_f32(b[i]);  // a head_dim that is not a multiple of W
  return sum;
}

// s[j] = q . k_j for the n keys at k, kstride elements apart. Keys up to `readable` may be read
// (the rest of their block): a group of W keys runs whole where it fits, and the scores past n it
// leaves in s are the caller's to ignore.
template <int DS, typename T>
inline void scores(const float* q, const T* k, int64_t kstride, int n, int readable, int d_rt, float* s) {
  const int d = DS > 0 ? DS : d_rt;
  int j = 0;
#if defined(__AVX2__) || defined(__AVX512F__)
  if (d % W == 0) {
    for (; j < n && j + W <= readable; j += W) {  // W keys at once: independent FMA chains, one reduction for all
      vf a[W];
      for (int u = 0; u < W; ++u) a[u] = vzero();
      for (int i = 0; i < d; i += W) {
        const vf qi = vload(q + i);
        for (int u = 0; u < W; ++u) a[u] = vfma(qi, vload(k + (j + u) * kstride + i), a[u]);
      }
#if defined(__AVX512F__)
      vstore(s + j, reduce16(a));
#else
      vstore(s + j, reduce8(a));
#endif
    }
  }
#endif
  for (; j < n; ++j) s[j] = dot<DS>(q, k + j * kstride, d);
}

// acc[0, NC * W) += sum_j p[j] v_j[0, NC * W): the accumulators stay in registers, two sets (even
// and odd keys) so that each FMA chain waits on its latency half as often.
template <int NC, typename T>
inline void accumulate_regs(float* acc, const float* p, const T* v, int64_t vstride, int n) {
  vf a[NC], b[NC];
  for (int c = 0; c < NC; ++c) a[c] = vload(acc + c * W), b[c] = vzero();
  int j = 0;
  for (; j + 2 <= n; j += 2) {
    const vf p0 = vset1(p[j]), p1 = vset1(p[j + 1]);
    const T *v0 = v + j * vstride, *v1 = v0 + vstride;
    for (int c = 0; c < NC; ++c) a[c] = vfma(p0, vload(v0 + c * W), a[c]);
    for (int c = 0; c < NC; ++c) b[c] = vfma(p1, vload(v1 + c * W), b[c]);
  }
  if (j < n) {
    const vf p0 = vset1(p[j]);
    for (int c = 0; c < NC; ++c) a[c] = vfma(p0, vload(v + j * vstride + c * W), a[c]);
  }
  for (int c = 0; c < NC; ++c) vstore(acc + c * W, vadd(a[c], b[c]));
}

// acc += sum_j p[j] v_j over the n rows at v, vstride elements apart: 8 vectors of acc at a time
// (a count the compiler knows, so they are registers), then any rest element by element.
template <int DS, typename T>
inline void accumulate(float* acc, const float* p, const T* v, int64_t vstride, int n, int d_rt) {
  const int d = DS > 0 ? DS : d_rt;
  int i = 0;
  if constexpr (DS > 0 && DS % W == 0 && DS / W < 8) {
    accumulate_regs<DS / W>(acc, p, v, vstride, n);
    return;
  }
  for (; i + 8 * W <= d; i += 8 * W) accumulate_regs<8>(acc + i, p, v + i, vstride, n);
  for (; i + W <= d; i += W) accumulate_regs<1>(acc + i, p, v + i, vstride, n);
  for (; i < d; ++i)
    for (int j = 0; j < n; ++j) acc[i] += p[j] * to_f32(v[j * vstride + i]);
}

// One row's scores s[0, nv) of a block into its running softmax: the max m (rescaling what acc and l
// hold under a smaller one), then s[j] = exp(s[j] - m), summed into l. s has room for whole vectors.
inline void softmax_update(float* s, int nv, int d, float& m, float& l, float* acc) {
  const int nvw = (nv + W - 1) / W * W;  // whole vectors: the lanes past nv hold -inf for the max
  for (int j = nv; j < nvw; ++j) s[j] = kNegInf;
  vf vm = vload(s);
  for (int j = W; j < nvw; j += W) vm = vmax(vm, vload(s + j));
  const float bm = vhmax(vm);
  if (bm > m) {  // a new running max: rescale what was accumulated under the old one
    if (m != kNegInf) {
      const float alpha = std::exp(m - bm);
      l *= alpha;
      for (int i = 0; i < d; ++i) acc[i] *= alpha;
    }
    m = bm;
  }
  const vf neg_m = vset1(-m);
  vf vs = vzero();
  for (int j = 0; j < nvw; j += W) {
    const vf e = vexp(vadd(vload(s + j), neg_m));
    vstore(s + j, e);
    vs = vadd(vs, e);
  }
  l += vsum(vs);  // the padding adds exp's floor (~1e-38 a lane): lost beside the real lanes
}

// rows [0, n) of one kv head's block (stride elements apart) as float32 rows of d, contiguous
template <int DS, typename T>
inline void widen_rows(const T* src, int64_t stride, int n, int d_rt, float* dst) {
  const int d = DS > 0 ? DS : d_rt;
  for (int j = 0; j < n; ++j) {
    const T* row = src + j * stride;
    float* out = dst + j * d;
    int i = 0;
    for (; i + W <= d; i += W) vstore(out + i, vload(row + i));
    for (; i < d; ++i) out[i] = to_f32(row[i]);
  }
}

constexpr int32_t kAllKeys = std::numeric_limits<int32_t>::max();

struct Item {
  int32_t seq, h0, h1, t0, t1;  // sequence, kv heads [h0, h1), query tokens [t0, t1) of its rows
  int32_t k0 = 0, k1 = kAllKeys;  // keys [k0, k1) (k0 on a block boundary): a part of a split decode
  int32_t part = -1;              // -1: rows go to out; else their first row in Args::partial
};

// A decode whose keys were cut into `parts` items: part p leaves query head h's state in
// Args::partial row base + p * heads + h.
struct Split {
  int32_t seq, parts, base;
};

struct Args {
  const void *q, *k, *v;
  void* out;
  const int32_t *tables, *info;
  int64_t heads, kv_heads, d, bs;
  int64_t q_s0, q_s1, o_s0, o_s1;  // row and head strides of q and out
  float scale;
  float* partial;  // split decodes' partial states: rows of d + 2 floats (acc[d], m, l)
  const float *k_scale, *v_scale;  // an 8-bit cache's [kv_heads, d] scales; null for float caches
  int32_t window;  // > 0: a row at position p sees keys p - window + 1 .. p
  float softcap;   // > 0: scores become softcap * tanh(score / softcap)

  int key_start(int pos) const { return window > 0 ? std::max(0, pos - window + 1) : 0; }
};

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
  std::vector<float> lv;                       // the bf16-dot decode path: per-lane softmax sums, 16 a row
  std::vector<uint16_t> qh, vp, pb;            // the bf16-dot path: q rows, V's row pairs, probabilities
  void fit(int64_t rows, int64_t d, int64_t bs) {
    if (static_cast<int64_t>(qh.size()) < rows * d) qh.resize(rows * d);
    if (static_cast<int64_t>(vp.size()) < (bs + 1) * d) vp.resize((bs + 1) * d), pb.resize(bs + W + 1);
    if (static_cast<int64_t>(q.size()) < rows * d) q.resize(rows * d), acc.resize(rows * d);
    if (static_cast<int64_t>(kw.size()) < bs * d) kw.resize(bs * d), vw.resize(bs * d);
    if (static_cast<int64_t>(m.size()) < rows) m.resize(rows), l.resize(rows), lv.resize(rows * 16);
    // a block's scores in whole vectors (from an offset of one key: run_item), or 16 for each of
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

template <int DS, typename TQ, typename TKV>
void run_item(const Args& a, const Item& it, Scratch& sc, const Item* next) {
  const int d = DS > 0 ? DS : static_cast<int>(a.d);
  const int G = static_cast<int>(a.heads / a.kv_heads);
  const int bs = static_cast<int>(a.bs);
  const int32_t* info = a.info + 4 * it.seq;
  const int row0 = info[0], first_pos = info[2] - info[1];
  const int HG = (it.h1 - it.h0) * G;  // query heads per token: those of kv heads h0..h1, in order
  const int R = (it.t1 - it.t0) * HG;  // rows: token-major
  float *qb = sc.q.data(), *acc = sc.acc.data(), *m = sc.m.data(), *l = sc.l.data(), *s = sc.s.data();
  const TQ* q = static_cast<const TQ*>(a.q);
  for (int r = 0; r < R; ++r) {
    const TQ* src = q + (row0 + it.t0 + r / HG) * a.q_s0 + (it.h0 * G + r % HG) * a.q_s1;
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
  constexpr bool kDot = kBF16Dot && std::is_same_v<TKV, BF16> && DS > 0 && DS % 32 == 0;
  if constexpr (kDot) {  // the scaled q rows rounded to bf16
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < d; i += W) vstore(reinterpret_cast<BF16*>(sc.qh.data()) + r * d + i, vload(qb + r * d + i));
  }
  const int n_keys = std::min(first_pos + it.t1, it.k1);  // keys up to the last row's position
  const int32_t* table = a.tables + info[3];
  const int64_t kstride = a.kv_heads * d;  // from one slot's row of a head to the next slot's
  // A non-float32 cache's block rows of one kv head are widened to float32 once (into sc.kw / sc.vw)
  // and read from there by every query row of that kv head: its G heads and the tile's tokens.
  constexpr bool kWiden = !std::is_same_v<TKV, float> && !kDot;
  const int per_head = (it.t1 - it.t0) * G;  // query rows of one kv head
  // The block after the one at key kb may be anywhere in the pool (a pool churned by many requests
  // scatters every table): fetch it while this one is used, a kv head's share of its rows before
  // each kv head's work (hh of the item's nh); on an item's last block, the first block of `next`
  // (the thread's next item, or null). Issued all at once, they fill the core's miss buffers while
  // the block's own arithmetic waits: 30 layers of 64 decodes over a scattered, cold bf16 cache take
  // ~16 ms so and ~14.3 ms spread; over a fresh engine's contiguous tables, the same.
  const int nh = it.h1 - it.h0;
  // rows [rows * part / parts, rows * (part + 1) / parts) of the block holding key x; past this
  // item's blocks, x continues into the next item's keys
  auto prefetch_part = [&](int x, int part, int parts) {
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
    prefetch_block(a, static_cast<int64_t>(blk) * bs * kstride + h0 * d + j0 * kstride, j1 - j0,
                   kstride, heads * d * static_cast<int64_t>(sizeof(TKV)), static_cast<const TKV*>(nullptr));
  };
  // a kv head's share of the block after the one at key kb (kb on a block boundary)
  auto prefetch_next = [&](int kb, int hh) { prefetch_part(kb + bs, hh, nh); };
  bool done = false;
  if constexpr (kDot && amxdecode::kAmxDecode && DS == 64) {
    if (it.t1 - it.t0 == 1 && R <= 16 && amxdecode::usable(true, d, bs)) {  // on AMX tiles
      float* lv = sc.lv.data();
      std::fill(lv, lv + R * 16, 0.f);
      amxdecode::attend(sc.qh.data(), G, nh, static_cast<const BF16*>(a.k), static_cast<const BF16*>(a.v), table, bs,
                        kstride, it.h0, it.k0, n_keys, std::max(it.k0, a.key_start(first_pos + it.t0)), a.softcap,
                        m, lv, acc, prefetch_part);
      for (int r = 0; r < R; ++r) l[r] = sum16(lv + 16 * r);
      done = true;
    }
  }
  if constexpr (kDot) {
    if (it.t1 - it.t0 == 1 && !done) {  // one token (a decode): every head of a kv head at once, 16 keys at a time
      float* lv = sc.lv.data();
      std::fill(lv, lv + R * 16, 0.f);
      const int ws = a.key_start(first_pos + it.t0);  // the window's first key
      for (int kb = it.k0; kb < n_keys; kb += bs) {
        const int n = std::min(bs, n_keys - kb);  // all at or before the token's position
        const int64_t block = static_cast<int64_t>(table[kb / bs]) * bs * kstride;
        const int j_first = std::max(0, ws - kb) / 16 * 16;  // the first group of 16 with a key in the window
        for (int hh = 0; hh < nh; ++hh) {
          prefetch_next(kb, hh);
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
      for (int r = 0; r < R; ++r) l[r] = sum16(lv + 16 * r);
      done = true;
    }
  }
  for (int kb = it.k0; kb < n_keys && !done; kb += bs) {
    const int n = std::min(bs, n_keys - kb);
    const int64_t block = static_cast<int64_t>(table[kb / bs]) * bs * kstride;
    for (int hh = 0; hh < nh; ++hh) {
      prefetch_next(kb, hh);
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
        readable = std::min(bs, (n + W - 1) / W * W);  // whole groups of W keys for scores()
        widen_rows<DS>(kp, kstride, readable, d, sc.kw.data());
        widen_rows<DS>(vp, kstride, n, d, sc.vw.data());
        krows = sc.kw.data(), vrows = sc.vw.data(), fstride = d;
      } else {
        krows = kp, vrows = vp, fstride = kstride;
      }
      for (int rr = 0; rr < per_head; ++rr) {
        const int tt = rr / G, r = tt * HG + hh * G + rr % G;  // row r: token it.t0 + tt, head h0 * G + hh * G + g
        const int pos = first_pos + it.t0 + tt;
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
  }
  if constexpr (kDot) {  // the sums back in the order of dims
    for (int r = 0; r < R; ++r) unpermute_bf16<DS>(acc + r * d);
  }
  if (it.part >= 0) {  // a part of a split decode: its rows' state, for merge_parts
    for (int r = 0; r < R; ++r) {
      float* p = a.partial + (it.part + r) * (d + 2);
      std::copy(acc + r * d, acc + (r + 1) * d, p);
      p[d] = m[r];
      p[d + 1] = l[r];
    }
    return;
  }
  TQ* out = static_cast<TQ*>(a.out);
  for (int r = 0; r < R; ++r) {
    TQ* dst = out + (row0 + it.t0 + r / HG) * a.o_s0 + (it.h0 * G + r % HG) * a.o_s1;
    const float inv = 1.f / l[r];
    if (a.v_scale) {  // sum_j p_j (v_j x s) = (sum_j p_j v_j) x s
      const float* vs = a.v_scale + (it.h0 + (r % HG) / G) * d;
      for (int i = 0; i < d; ++i) dst[i] = static_cast<TQ>(acc[r * d + i] * inv * vs[i]);
    } else {
      for (int i = 0; i < d; ++i) dst[i] = static_cast<TQ>(acc[r * d + i] * inv);
    }
  }
}

// One query head of a split decode: its parts' states (acc_p, m_p, l_p) are each relative to
// their own max; with m = max m_p and e_p = exp(m_p - m), out = sum e_p acc_p / sum e_p l_p.
// Summed into part 0's row in place.
template <typename TQ>
void merge_parts(const Args& a, const Split& sp, int64_t h) {
  const int64_t d = a.d, pstride = a.heads * (d + 2);  // from one part's row of head h to the next part's
  float* r0 = a.partial + (sp.base + h) * (d + 2);
  float m = kNegInf;
  for (int p = 0; p < sp.parts; ++p) m = std::max(m, r0[p * pstride + d]);
  float e = std::exp(r0[d] - m), l = r0[d + 1] * e;
  for (int64_t i = 0; i < d; ++i) r0[i] *= e;
  for (int p = 1; p < sp.parts; ++p) {
    const float* rp = r0 + p * pstride;
    e = std::exp(rp[d] - m);
    l += rp[d + 1] * e;
    for (int64_t i = 0; i < d; ++i) r0[i] += rp[i] * e;
  }
  TQ* dst = static_cast<TQ*>(a.out) + a.info[4 * sp.seq] * a.o_s0 + h * a.o_s1;
  const float inv = 1.f / l;
  const float* vs = a.v_scale ? a.v_scale + h / (a.heads / a.kv_heads) * d : nullptr;
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<TQ>(r0[i] * inv * (vs ? vs[i] : 1.f));
}

// Items [i0, i1) on the calling thread.
template <int DS, typename TQ, typename TKV>
void run_items(const Args& a, const std::vector<Item>& items, int64_t i0, int64_t i1) {
  Scratch& sc = tl_scratch;
  sc.fit(std::max<int64_t>(kTile, a.kv_heads) * (a.heads / a.kv_heads), a.d, a.bs);
  const bool tiles = amxdecode::usable(std::is_same_v<TKV, BF16>, a.d, a.bs);
  if (tiles) amxdecode::configure();  // decode items run on AMX tiles (amx_decode.h)
  for (int64_t i = i0; i < i1; ++i) run_item<DS, TQ, TKV>(a, items[i], sc, i + 1 < i1 ? &items[i + 1] : nullptr);
  if (tiles) amxdecode::release();
}

using RunItems = void (*)(const Args&, const std::vector<Item>&, int64_t, int64_t);
using MergeParts = void (*)(const Args&, const Split&, int64_t);

template <typename TQ, typename TKV>
RunItems run_items_for(int64_t d) {
  if (d == 64) return &run_items<64, TQ, TKV>;  // the common head sizes, unrolled
  if (d == 128) return &run_items<128, TQ, TKV>;
  return &run_items<0, TQ, TKV>;
}

// Items in sequence order, cut into one contiguous chunk per thread of about equal cost: rows x
// keys read, plus a fixed cost per item.
std::vector<int64_t> balance(const std::vector<Item>& items, const int32_t* info, int64_t G, int64_t threads) {
  std::vector<double> cum(items.size() + 1, 0.0);
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    const int32_t first_pos = info[4 * it.seq + 2] - info[4 * it.seq + 1];
    const int32_t keys = std::min(first_pos + it.t1, it.k1) - it.k0;
    cum[i + 1] = cum[i] + static_cast<double>((it.t1 - it.t0) * (it.h1 - it.h0) * G) * keys + 64.0;
  }
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(threads, items.size()));
  std::vector<int64_t> bounds{0};
  for (int64_t c = 1; c < chunks; ++c) {
    const double target = cum.back() * c / chunks;
    size_t i = bounds.back();
    while (i < items.size() && (cum[i] + cum[i + 1]) / 2 < target) ++i;  // an item goes where its middle falls
    bounds.push_back(i);
  }
  bounds.push_back(items.size());
  return bounds;
}

bool float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

bool eight_bit(const at::Tensor& t) {
  const auto s = t.scalar_type();
  return s == at::kChar || s == at::kFloat8_e4m3fn || s == at::kFloat8_e5m2;
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

namespace kvserve {

struct PagedAttentionPlan::Impl {
  std::vector<Item> items;
  std::vector<int64_t> bounds;  // chunk c: items [bounds[c], bounds[c + 1])
  std::vector<Split> splits;
  std::vector<float> partial;  // split decodes' partial states
  const int32_t *tables, *info;
  int64_t heads, kv_heads, d, bs;
  float scale;
  int32_t window;
  float softcap;
  RunItems run;
  MergeParts merge;

  Args args(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const float* k_scale, const float* v_scale) {
    return Args{q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), tables, info, heads, kv_heads, d, bs,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1), scale, partial.data(), k_scale, v_scale,
                window, softcap};
  }
};

PagedAttentionPlan::PagedAttentionPlan(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                                       const at::Tensor& v_cache, const at::Tensor& block_tables,
                                       const at::Tensor& seq_info, int64_t block_size, double scale, int64_t threads,
                                       int64_t window, double softcap)
    : impl_(std::make_shared<Impl>()) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "paged_attention: q and out must be [T, heads, d] of one dtype");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged_attention: q and out need a contiguous last dim");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_attention: k_cache and v_cache must be contiguous [slots, kv_heads, d] of one dtype");
  TORCH_CHECK(float_or_bf16(q) && (float_or_bf16(k_cache) || eight_bit(k_cache)),
              "paged_attention: q float32 or bfloat16; caches float32, bfloat16, int8 or fp8");
  const int64_t heads = q.size(1), kv_heads = k_cache.size(1), d = q.size(2);
  TORCH_CHECK(k_cache.size(2) == d && heads % kv_heads == 0, "paged_attention: heads/kv_heads/d mismatch");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_info.scalar_type() == at::kInt &&
                  block_tables.dim() == 1 && seq_info.dim() == 2 && seq_info.size(1) == 4 &&
                  block_tables.is_contiguous() && seq_info.is_contiguous(),
              "paged_attention: block_tables int32 [N] and seq_info int32 [S, 4], contiguous");
  TORCH_CHECK(block_size >= 1, "paged_attention: block_size must be positive");
  TORCH_CHECK(softcap >= 0 && window <= std::numeric_limits<int32_t>::max(), "paged_attention: bad window or softcap");
  const int32_t win = static_cast<int32_t>(std::max<int64_t>(window, 0));
  const int64_t S = seq_info.size(0), num_entries = block_tables.size(0), T = q.size(0);
  const int64_t num_blocks = k_cache.size(0) / block_size;
  const int32_t* info = seq_info.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  // A decode item takes the G heads of hp kv heads, so it streams whole slot rows of the cache
  // (per kv head, strided reads cost 2.5x at 64 decodes); fewer when there are few sequences,
  // so every thread has items. Multi-token items take one kv head and a tile of tokens.
  int64_t hp = kv_heads;
  while (hp > 1 && S * ((kv_heads + hp - 1) / hp) < 4 * threads) --hp;
  // AMX tiles take up to 16 query rows: as many kv heads as fit (amx_decode.h)
  if (amxdecode::usable(k_cache.scalar_type() == at::kBFloat16, d, block_size))
    hp = std::min<int64_t>(hp, std::max<int64_t>(1, 16 / (heads / kv_heads)));
  // Flash-decoding (split-K). A decode's work is one pass over its context: with few sequences
  // the items above are too few to balance (3 kv heads on 2 threads: one thread does 2/3), and
  // each streams its K/V from memory one block after another. So a decode costing more than half
  // a thread's share of the call is cut along its keys into parts of whole blocks (about half a
  // share each, at least kMinPartKeys keys), one item per part over all kv heads (whole,
  // contiguous slot rows: faster than a kv head per item here). Each part leaves its rows'
  // softmax state (max m, sum l, unnormalised acc) in `partial`; merge_parts combines them.
  // the first key row t of a sequence whose first row sits at position p0 reads (its window's start)
  auto key_start = [win](int64_t p) { return win > 0 ? std::max<int64_t>(0, p - win + 1) : 0; };
  double total = 0;  // rows x keys
  for (int64_t s = 0; s < S; ++s) {
    const int64_t ctx = std::max(info[4 * s + 2], 1), rows = std::max(info[4 * s + 1], 1);
    total += rows * static_cast<double>(ctx - std::min(key_start(ctx - rows), ctx - 1));
  }
  Impl& p = *impl_;
  std::vector<Item>& items = p.items;
  std::vector<Split>& splits = p.splits;
  int32_t partial_rows = 0;
  for (int64_t s = 0; s < S; ++s) {  // check every index the kernel will follow, then build the items
    const int32_t row0 = info[4 * s], nq = info[4 * s + 1], ctx = info[4 * s + 2], offset = info[4 * s + 3];
    const int64_t used = (ctx + block_size - 1) / block_size;
    TORCH_CHECK(row0 >= 0 && nq >= 1 && row0 + nq <= T && ctx >= nq, "paged_attention: bad seq_info row ", s);
    TORCH_CHECK(offset >= 0 && offset + used <= num_entries, "paged_attention: block table too short, row ", s);
    // blocks [b0, used): those before the first row's window are never read, nor their table entries
    const int64_t b0 = key_start(ctx - nq) / block_size, nb = used - b0;
    for (int64_t b = b0; b < used; ++b) {
      const int32_t blk = tables[offset + b];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "paged_attention: block id out of range, row ", s);
    }
    const int32_t si = static_cast<int32_t>(s);
    int64_t parts = 1;
    if (nq == 1 && threads > 1) {
      const int64_t want = static_cast<int64_t>(std::ceil(2 * threads * (ctx - b0 * block_size) / total - 1e-9));
      parts = std::min(want, nb / ((kMinPartKeys + block_size - 1) / block_size));
    }
    auto key = [&](int64_t b) { return static_cast<int32_t>(std::min<int64_t>(ctx, b * block_size)); };
    if (parts >= 2) {
      splits.push_back({si, static_cast<int32_t>(parts), partial_rows});
      for (int64_t p = 0; p < parts; ++p)  // blocks b0 + [nb * p / parts, nb * (p + 1) / parts)
        items.push_back({si, 0, static_cast<int32_t>(kv_heads), 0, 1, key(b0 + nb * p / parts),
                         key(b0 + nb * (p + 1) / parts), static_cast<int32_t>(partial_rows + p * heads)});
      partial_rows += static_cast<int32_t>(parts * heads);
    } else if (nq == 1) {
      for (int32_t h = 0; h < kv_heads; h += hp)
        items.push_back({si, h, static_cast<int32_t>(std::min(kv_heads, h + hp)), 0, 1, key(b0)});
    } else {
      for (int32_t h = 0; h < kv_heads; ++h)
        for (int32_t t0 = 0; t0 < nq; t0 += kTile)  // from the block of the tile's first row's window start
          items.push_back({si, h, h + 1, t0, std::min(nq, t0 + kTile), key(key_start(ctx - nq + t0) / block_size)});
    }
  }
  p.partial.resize(partial_rows * (d + 2));
  p.bounds = items.empty() ? std::vector<int64_t>{0} : balance(items, info, heads / kv_heads, threads);
  p.tables = tables;
  p.info = info;
  p.heads = heads, p.kv_heads = kv_heads, p.d = d, p.bs = block_size;
  p.scale = static_cast<float>(scale);
  p.window = win;
  p.softcap = static_cast<float>(softcap);
  const bool q_f32 = q.scalar_type() == at::kFloat;
  p.run = q_f32 ? run_items_for_kv<float>(k_cache.scalar_type(), d) : run_items_for_kv<BF16>(k_cache.scalar_type(), d);
  p.merge = q_f32 ? &merge_parts<float> : &merge_parts<BF16>;
}

int64_t PagedAttentionPlan::num_chunks() const { return static_cast<int64_t>(impl_->bounds.size()) - 1; }

int64_t PagedAttentionPlan::num_merges() const { return static_cast<int64_t>(impl_->splits.size()) * impl_->heads; }

void PagedAttentionPlan::run_chunk(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, int64_t c, const float* k_scale,
                                   const float* v_scale) const {
  Impl& p = *impl_;
  p.run(p.args(out, q, k_cache, v_cache, k_scale, v_scale), p.items, p.bounds[c], p.bounds[c + 1]);
}

void PagedAttentionPlan::run_merges(const at::Tensor& out, int64_t begin, int64_t end, const float* v_scale) const {
  Impl& p = *impl_;
  const Args a = p.args(out, out, out, out, nullptr, v_scale);  // merging reads only partial and writes out
  for (int64_t i = begin; i < end; ++i) p.merge(a, p.splits[i / p.heads], i % p.heads);
}

void check_kv_scales(const at::Tensor& cache, const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale) {
  if (!eight_bit(cache)) {
    TORCH_CHECK(!k_scale && !v_scale, "paged_attention: scales are for an 8-bit cache only");
    return;
  }
  for (const auto* s : {&k_scale, &v_scale})
    TORCH_CHECK(*s && (*s)->scalar_type() == at::kFloat && (*s)->is_contiguous() && (*s)->dim() == 2 &&
                    (*s)->size(0) == cache.size(1) && (*s)->size(1) == cache.size(2),
                "paged_attention: an 8-bit cache needs float32 k_scale and v_scale [kv_heads, d]");
}

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_info, int64_t block_size, double scale,
                     const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale, int64_t window,
                     double softcap) {
  const PagedAttentionPlan plan(out, q, k_cache, v_cache, block_tables, seq_info, block_size, scale, at::get_num_threads(),
                                window, softcap);
  check_kv_scales(k_cache, k_scale, v_scale);
  const float* ks = k_scale ? k_scale->data_ptr<float>() : nullptr;
  const float* vs = v_scale ? v_scale->data_ptr<float>() : nullptr;
  at::parallel_for(0, plan.num_chunks(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) plan.run_chunk(out, q, k_cache, v_cache, c, ks, vs);
  });
  at::parallel_for(0, plan.num_merges(), 64, [&](int64_t begin, int64_t end) { plan.run_merges(out, begin, end, vs); });
}

}  // namespace kvserve

namespace {
bool bf16_dot_attention() { return kBF16Dot; }
bool amx_decode_attention() { return amxdecode::ready(); }
}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  // whether a bfloat16 cache is attended with bf16 pair dot products (this build has AVX512-BF16)
  m.def("bf16_dot_attention() -> bool", &bf16_dot_attention);
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_info, int block_size, float scale, Tensor? k_scale=None, Tensor? v_scale=None, int window=0, "
        "float softcap=0.0) -> ()",
        &kvserve::paged_attention);
  // whether decodes over a bfloat16 cache (head size 64) run on AMX tiles (amx_decode.h)
  m.def("amx_decode_attention() -> bool", &amx_decode_attention);
}
