// The paged attention kernel's work, shared by the plan that cuts it (paged_attention.cpp) and the
// code that runs it (paged_items.cpp): items, split decodes, and one call's arguments.
#pragma once
#include "common/common.h"
#include "common/vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace kvserve {
namespace paged {

constexpr int kTile = 16;  // query tokens per work item (multi-token rows)
// Every row's keys are cut at multiples of this many keys (rounded up to whole blocks: part_keys) into
// partitions, each streamed from an empty softmax state and folded into the row's total in key order
// (fold_rows). A row's arithmetic is then fixed by its position and context alone: the same whether it is
// a decode run whole, a decode split across threads (flash-decoding, one partition state per partial row), a
// verify row or a prompt row in a tile, and whatever else is in the call.
// 512: at 128 the extra folds and the softmax maxima restarting cost the prompt path 10-15% at 4k contexts; at
// 512, 2-4% (docs/benchmarks.md), and a decode still splits from 1,024 keys.
constexpr int kPartitionKeys = 512;
constexpr int32_t kAllKeys = std::numeric_limits<int32_t>::max();

struct Item {
  int32_t seq, h0, h1, t0, t1;  // sequence, kv heads [h0, h1), query tokens [t0, t1) of its rows
  int32_t k0 = 0, k1 = kAllKeys;  // keys [k0, k1) (k0 on a block boundary): a part of a split decode
  int32_t part = -1;              // -1: rows go to out; else their first partition's first row in Args::partial
};

// A decode whose keys were cut into items of whole partitions: partition p (counted from the first it
// reads) leaves query head h's state in Args::partial row base + p * heads + h; merge_parts folds them.
struct Split {
  int32_t seq, partitions, base;
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
  const float* sinks;  // per query head, a logit that joins each row's softmax denominator (gpt-oss); null: none
  int32_t part_keys;   // kPartitionKeys in whole blocks
  bool invariant;      // decodes over a bf16 cache take the multi-token rows' path, not their own shortcuts

  int key_start(int pos) const { return window > 0 ? std::max(0, pos - window + 1) : 0; }
};

// 1 / a row's softmax denominator, as its output's factor (acc holds sum_j exp(s_j - m) v_j, l the sum of
// those weights): with a sink logit, exp(sink - m) joins l, computed under max(m, sink) so it cannot overflow
[[gnu::noinline, gnu::optimize("no-fast-math", "no-math-errno", "fp-contract=off")]] inline float softmax_inverse(float m, float l, const float* sinks, int64_t head) {
  if (sinks == nullptr) return 1.f / l;
  const float top = std::max(m, sinks[head]), e = std::exp(m - top);
  return e / (l * e + std::exp(sinks[head] - top));
}

inline int32_t partition_keys(int64_t block_size) {
  return static_cast<int32_t>((kPartitionKeys + block_size - 1) / block_size * block_size);
}

// Rows [0, n): each row's state so far (m, l, acc: row r's d accumulators at acc + r * d) folded with the
// state (mp, lp, accp) of its next partition, each rescaled to the larger max; an empty partition (mp = -inf:
// none of its keys visible) changes nothing. into_next: the result goes to the partition's state instead
// (an item's last one: no copy back), the same bits (the two products are added, which commutes).
// The exponentials of a call's rows go through vexp together.
// Out of line and without -ffast-math, like store_output and softmax_inverse: fast-math lets the compiler
// order float arithmetic differently wherever a function is inlined, and differently in a vectorised loop's
// body and its alignment peel (so by where a buffer happens to start), and a split decode's merge must
// compute what an unsplit one computes, bit for bit.
[[gnu::noinline, gnu::optimize("no-fast-math", "no-math-errno", "fp-contract=off")]] inline void fold_rows(
    int n, float* m, float* l, float* acc, float* mp, float* lp, float* accp, int64_t d, bool into_next = false) {
  using namespace kvserve::vec;
  constexpr float kNoKeys = -std::numeric_limits<float>::infinity();
  for (int r0 = 0; r0 < n; r0 += W) {
    alignas(64) float a[W], b[W], e[W], ep[W];
    const int k = std::min(W, n - r0);
    for (int j = 0; j < W; ++j) {  // lanes without two states to combine: exp(0), unused
      const bool both = j < k && mp[r0 + j] != kNoKeys && m[r0 + j] != kNoKeys;
      const float top = both ? std::max(m[r0 + j], mp[r0 + j]) : 0.f;
      a[j] = both ? m[r0 + j] - top : 0.f;
      b[j] = both ? mp[r0 + j] - top : 0.f;
    }
    vstore(e, vexp(vload(a)));
    vstore(ep, vexp(vload(b)));
    for (int j = 0; j < k; ++j) {
      const int r = r0 + j;
      float *t = acc + r * d, *p = accp + r * d;
      float *to_m = into_next ? mp + r : m + r, *to_l = into_next ? lp + r : l + r, *to = into_next ? p : t;
      if (mp[r] == kNoKeys || m[r] == kNoKeys) {  // one side empty: the result is the other side
        const bool from_p = m[r] == kNoKeys;
        if (from_p != into_next) {
          *to_m = from_p ? mp[r] : m[r], *to_l = from_p ? lp[r] : l[r];
          std::copy(from_p ? p : t, (from_p ? p : t) + d, to);
        }
        continue;
      }
      const float top = std::max(m[r], mp[r]), sum = l[r] * e[j] + lp[r] * ep[j];
      *to_m = top, *to_l = sum;
      for (int64_t i = 0; i < d; ++i) to[i] = t[i] * e[j] + p[i] * ep[j];
    }
  }
}

// A row's output: its accumulators times 1 / its softmax sum (inv), times an 8-bit cache's V scales (vs; null:
// none). One out-of-line copy per output type, for the reason fold_rows gives.
template <typename TQ>
[[gnu::noinline, gnu::optimize("no-fast-math", "no-math-errno", "fp-contract=off")]] void store_output(TQ* dst, const float* acc, float inv, const float* vs, int64_t d) {
  if (vs != nullptr) {  // sum_j p_j (v_j x s) = (sum_j p_j v_j) x s
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<TQ>(acc[i] * inv * vs[i]);
  } else {
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<TQ>(acc[i] * inv);
  }
}

// Items [i0, i1) on the calling thread; one split decode's query head h merged into out.
using RunItems = void (*)(const Args&, const std::vector<Item>&, int64_t, int64_t);
using MergeParts = void (*)(const Args&, const Split&, int64_t);

// The runner for q of float32 (else bf16), a cache of dtype kv and head size d; the merger likewise.
RunItems items_runner(bool q_f32, at::ScalarType kv, int64_t d);
MergeParts parts_merger(bool q_f32);

}  // namespace paged
}  // namespace kvserve
