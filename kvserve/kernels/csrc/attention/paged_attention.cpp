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
// c tanh(s / c) before the softmax (Gemma 2). Sinks, a logit per query head, join each row's softmax
// denominator and weigh no value (gpt-oss).
// Work items are (sequence, kv heads, tile of query tokens): all the GQA heads of their kv heads and
// up to kTile tokens share each pass over a K/V block, so each K/V row is read once per item.
// Items are cut into per-thread chunks of equal estimated cost, so a few long contexts among
// many short ones do not leave threads idle. A decode that is a large share of the call (few
// sequences, long context) is also split along its keys into parts run as separate items, whose
// softmax states are merged afterwards (flash-decoding; see paged_attention()).
//
// This file cuts a call into items (PagedAttentionPlan); paged_items.cpp runs them.
#include "attention/amx_decode.h"
#include "attention/bf16_dot.h"
#include "attention/paged_work.h"
#include "common/ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using namespace kvserve::paged;
namespace amxdecode = kvserve::amxdecode;

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

void check_inputs(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_info, int64_t block_size, int64_t window,
                  double softcap) {
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
}

// Cuts a call's sequences into items, after checking every index the kernel will follow.
struct ItemCutter {
  std::vector<Item>& items;
  std::vector<Split>& splits;
  const int32_t *info, *tables;
  int64_t T, num_entries, num_blocks, block_size, heads, kv_heads, threads;
  int32_t win;
  int64_t part_keys;  // partition_keys(block_size)
  int64_t hp = 1;     // kv heads per decode item
  double total = 0;   // rows x keys of the whole call
  int32_t partial_rows = 0;

  // the first key row t of a sequence whose first row sits at position p0 reads (its window's start)
  int64_t key_start(int64_t p) const { return win > 0 ? std::max<int64_t>(0, p - win + 1) : 0; }

  // A decode item takes the G heads of hp kv heads, so it streams whole slot rows of the cache
  // (per kv head, strided reads cost 2.5x at 64 decodes); fewer when there are few sequences,
  // so every thread has items. Multi-token items take one kv head and a tile of tokens.
  void plan_decode_heads(int64_t S, bool amx_tiles) {
    hp = kv_heads;
    while (hp > 1 && S * ((kv_heads + hp - 1) / hp) < 4 * threads) --hp;
    // AMX tiles take up to 16 query rows: as many kv heads as fit (amx_decode.h)
    if (amx_tiles) hp = std::min<int64_t>(hp, std::max<int64_t>(1, 16 / (heads / kv_heads)));
  }

  void sum_cost(int64_t S) {
    for (int64_t s = 0; s < S; ++s) {
      const int64_t ctx = std::max(info[4 * s + 2], 1), rows = std::max(info[4 * s + 1], 1);
      total += rows * static_cast<double>(ctx - std::min(key_start(ctx - rows), ctx - 1));
    }
  }

  // Flash-decoding (split-K). A decode's work is one pass over its context: with few sequences
  // the items above are too few to balance (3 kv heads on 2 threads: one thread does 2/3), and
  // each streams its K/V from memory one block after another. So a decode costing more than half
  // a thread's share of the call is cut along its keys into parts of whole partitions (about half a
  // share each), one item per part over all kv heads (whole, contiguous slot rows: faster than a kv
  // head per item here). Each part leaves each of its partitions' softmax state (max m, sum l,
  // unnormalised acc) in `partial`; merge_parts folds them in key order, as an unsplit decode folds
  // its partitions as it goes (paged_work.h), so splitting changes no result.
  void add_sequence(int64_t s) {
    const int32_t row0 = info[4 * s], nq = info[4 * s + 1], ctx = info[4 * s + 2], offset = info[4 * s + 3];
    const int64_t used = (ctx + block_size - 1) / block_size;
    TORCH_CHECK(row0 >= 0 && nq >= 1 && row0 + nq <= T && ctx >= nq, "paged_attention: bad seq_info row ", s);
    TORCH_CHECK(offset >= 0 && offset + used <= num_entries, "paged_attention: block table too short, row ", s);
    // blocks [b0, used): those before the first row's window are never read, nor their table entries
    const int64_t b0 = key_start(ctx - nq) / block_size;
    for (int64_t b = b0; b < used; ++b) {
      const int32_t blk = tables[offset + b];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "paged_attention: block id out of range, row ", s);
    }
    const int32_t si = static_cast<int32_t>(s);
    // the partitions the keys [b0 * block_size, ctx) touch: absolute indices [first, first + np)
    const int64_t first = b0 * block_size / part_keys, np = (ctx - 1) / part_keys - first + 1;
    int64_t parts = 1;
    if (nq == 1 && threads > 1) {
      const int64_t want = static_cast<int64_t>(std::ceil(2 * threads * (ctx - b0 * block_size) / total - 1e-9));
      parts = std::min(want, np);
    }
    auto key = [&](int64_t b) { return static_cast<int32_t>(std::min<int64_t>(ctx, b * block_size)); };
    if (parts >= 2) {
      splits.push_back({si, static_cast<int32_t>(np), partial_rows});
      for (int64_t p = 0; p < parts; ++p) {  // partitions first + [np * p / parts, np * (p + 1) / parts)
        const int64_t p0 = np * p / parts, p1 = np * (p + 1) / parts;
        const int64_t k0 = std::max(b0 * block_size, (first + p0) * part_keys), k1 = std::min<int64_t>(ctx, (first + p1) * part_keys);
        items.push_back({si, 0, static_cast<int32_t>(kv_heads), 0, 1, static_cast<int32_t>(k0), static_cast<int32_t>(k1),
                         static_cast<int32_t>(partial_rows + p0 * heads)});
      }
      partial_rows += static_cast<int32_t>(np * heads);
    } else if (nq == 1) {
      for (int32_t h = 0; h < kv_heads; h += hp)
        items.push_back({si, h, static_cast<int32_t>(std::min(kv_heads, h + hp)), 0, 1, key(b0)});
    } else {
      for (int32_t h = 0; h < kv_heads; ++h)
        for (int32_t t0 = 0; t0 < nq; t0 += kTile)  // from the block of the tile's first row's window start
          items.push_back({si, h, h + 1, t0, std::min(nq, t0 + kTile), key(key_start(ctx - nq + t0) / block_size)});
    }
  }
};

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
  bool invariant;
  RunItems run;
  MergeParts merge;

  Args args(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const float* k_scale, const float* v_scale, const float* sinks) {
    return Args{q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), tables, info, heads, kv_heads, d, bs,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1), scale, partial.data(), k_scale, v_scale,
                window, softcap, sinks, partition_keys(bs), invariant};
  }
};

PagedAttentionPlan::PagedAttentionPlan(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                                       const at::Tensor& v_cache, const at::Tensor& block_tables,
                                       const at::Tensor& seq_info, int64_t block_size, double scale, int64_t threads,
                                       int64_t window, double softcap, bool invariant)
    : impl_(std::make_shared<Impl>()) {
  check_inputs(out, q, k_cache, v_cache, block_tables, seq_info, block_size, window, softcap);
  const int64_t heads = q.size(1), kv_heads = k_cache.size(1), d = q.size(2);
  const int32_t win = static_cast<int32_t>(std::max<int64_t>(window, 0));
  const int64_t S = seq_info.size(0), num_entries = block_tables.size(0), T = q.size(0);
  const int64_t num_blocks = k_cache.size(0) / block_size;
  const int32_t* info = seq_info.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  Impl& p = *impl_;
  ItemCutter cut{p.items, p.splits, info, tables, T, num_entries, num_blocks, block_size, heads, kv_heads, threads, win,
                 partition_keys(block_size)};
  cut.plan_decode_heads(S, !invariant && amxdecode::usable(k_cache.scalar_type() == at::kBFloat16, d, block_size));
  cut.sum_cost(S);
  for (int64_t s = 0; s < S; ++s) cut.add_sequence(s);
  p.partial.resize(cut.partial_rows * (d + 2));
  p.bounds = p.items.empty() ? std::vector<int64_t>{0} : balance(p.items, info, heads / kv_heads, threads);
  p.tables = tables;
  p.info = info;
  p.heads = heads, p.kv_heads = kv_heads, p.d = d, p.bs = block_size;
  p.scale = static_cast<float>(scale);
  p.window = win;
  p.softcap = static_cast<float>(softcap);
  p.invariant = invariant;
  const bool q_f32 = q.scalar_type() == at::kFloat;
  p.run = items_runner(q_f32, k_cache.scalar_type(), d);
  p.merge = parts_merger(q_f32);
}

int64_t PagedAttentionPlan::num_chunks() const { return static_cast<int64_t>(impl_->bounds.size()) - 1; }

int64_t PagedAttentionPlan::num_merges() const { return static_cast<int64_t>(impl_->splits.size()) * impl_->heads; }

void PagedAttentionPlan::run_chunk(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, int64_t c, const float* k_scale,
                                   const float* v_scale, const float* sinks) const {
  Impl& p = *impl_;
  p.run(p.args(out, q, k_cache, v_cache, k_scale, v_scale, sinks), p.items, p.bounds[c], p.bounds[c + 1]);
}

void PagedAttentionPlan::run_merges(const at::Tensor& out, int64_t begin, int64_t end, const float* v_scale,
                                    const float* sinks) const {
  Impl& p = *impl_;
  const Args a = p.args(out, out, out, out, nullptr, v_scale, sinks);  // merging reads only partial and writes out
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
                     double softcap, const std::optional<at::Tensor>& sinks, bool invariant) {
  const PagedAttentionPlan plan(out, q, k_cache, v_cache, block_tables, seq_info, block_size, scale, at::get_num_threads(),
                                window, softcap, invariant);
  check_kv_scales(k_cache, k_scale, v_scale);
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == q.size(1)),
              "paged_attention: sinks float32 [heads]");
  const float* ks = k_scale ? k_scale->data_ptr<float>() : nullptr;
  const float* vs = v_scale ? v_scale->data_ptr<float>() : nullptr;
  const float* sk = sinks ? sinks->data_ptr<float>() : nullptr;
  at::parallel_for(0, plan.num_chunks(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) plan.run_chunk(out, q, k_cache, v_cache, c, ks, vs, sk);
  });
  at::parallel_for(0, plan.num_merges(), 64, [&](int64_t begin, int64_t end) { plan.run_merges(out, begin, end, vs, sk); });
}

}  // namespace kvserve

namespace {
bool bf16_dot_attention() { return kvserve::bf16dot::kBF16Dot; }
bool amx_decode_attention() { return amxdecode::ready(); }
}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  // whether a bfloat16 cache is attended with bf16 pair dot products (this build has AVX512-BF16)
  m.def("bf16_dot_attention() -> bool", &bf16_dot_attention);
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_info, int block_size, float scale, Tensor? k_scale=None, Tensor? v_scale=None, int window=0, "
        "float softcap=0.0, Tensor? sinks=None, bool invariant=False) -> ()",
        &kvserve::paged_attention);
  // whether decodes over a bfloat16 cache (head size 64) run on AMX tiles (amx_decode.h)
  m.def("amx_decode_attention() -> bool", &amx_decode_attention);
}
