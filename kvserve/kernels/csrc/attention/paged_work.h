// The paged attention kernel's work, shared by the plan that cuts it (paged_attention.cpp) and the
// code that runs it (paged_items.cpp): items, split decodes, and one call's arguments.
#pragma once
#include "common/common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace kvserve {
namespace paged {

constexpr int kTile = 16;  // query tokens per work item (multi-token rows)
constexpr int kMinPartKeys = 64;  // a split decode's parts have at least this many keys
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
  const float* sinks;  // per query head, a logit that joins each row's softmax denominator (gpt-oss); null: none

  int key_start(int pos) const { return window > 0 ? std::max(0, pos - window + 1) : 0; }
};

// 1 / a row's softmax denominator, as its output's factor (acc holds sum_j exp(s_j - m) v_j, l the sum of
// those weights): with a sink logit, exp(sink - m) joins l, computed under max(m, sink) so it cannot overflow
inline float softmax_inverse(float m, float l, const float* sinks, int64_t head) {
  if (sinks == nullptr) return 1.f / l;
  const float top = std::max(m, sinks[head]), e = std::exp(m - top);
  return e / (l * e + std::exp(sinks[head] - top));
}

// Items [i0, i1) on the calling thread; one split decode's query head h merged into out.
using RunItems = void (*)(const Args&, const std::vector<Item>&, int64_t, int64_t);
using MergeParts = void (*)(const Args&, const Split&, int64_t);

// The runner for q of float32 (else bf16), a cache of dtype kv and head size d; the merger likewise.
RunItems items_runner(bool q_f32, at::ScalarType kv, int64_t d);
MergeParts parts_merger(bool q_f32);

}  // namespace paged
}  // namespace kvserve
