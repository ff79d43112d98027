// kvserve::flash_prefill: causal attention of prompt chunks over a bf16 paged KV cache, both GEMMs
// (q . k^T and p . v) on oneDNN's brgemm ukernels (AMX tiles, through torch's at::native::cpublas)
// and the streaming softmax between them in AVX512.
//
//   out, q:        [T, heads, d]            bf16 or float32 (out written for the listed rows only; q's
//                                           rows may be strided, as a view of the fused qkv output)
//   k/v_cache:     bf16 [slots, kv_heads, d], slot = block * block_size + offset
//   block_tables:  int32 [N]                every sequence's blocks, one table after another
//   seq_info:      int32 [S, 4]             (first q row, q rows, context length incl. them, table offset)
//
// Query row i of sequence s sits at position ctx - n + i and attends to keys 0..that position, all
// read from the cache (the step has stored its own rows' K/V before calling), so a chunk that
// continues a context needs no gather and no merge of partial attentions. With a sliding window
// w > 0 it sees only the w keys ending at its position: keys before the sequence's first row's window
// are neither packed nor looked up in the table (their entries may be placeholders), and a task
// starts at the block of keys holding its first row's window start. A soft cap c > 0 turns each
// scaled score s into c tanh(s / c) before the softmax (Gemma 2).
//
// Why not torch's flash attention (what these chunks used before): at head_dim 64 its softmax
// (exp, sums, conversions) takes ~60% of its time and its GEMMs the rest; it runs each query head
// on its own. Here the G query heads of a kv head are stacked as the rows of one matrix (row =
// token * G + head; the causal bound follows the token), so each GEMM has G times the rows, and
// the softmax is one pass per block over the scores: exp2 (a degree-3 polynomial: < 8e-5 relative
// error, far below the bf16 rounding of the probabilities that p . v reads), the sum and the bf16
// probabilities, against a reference max that rarely moves (softmax_block).
//
// Work: each (sequence, kv head) has its keys packed once per call into the brgemm's layouts (K
// transposed and V with row pairs interleaved: bf16 pairs along the reduced dimension), padded to
// kKeyAlign keys with zeros, in chunks of kBK keys: sequences that share a prefix's blocks share its
// chunks (packed once), and every q . k^T has the same leading dimension (one brgemm kernel per
// shape, whatever the context's length). Then tasks of (sequence, kv head, up to 64 query tokens:
// 32 where more than 4 query heads share a kv head), the costliest first, are taken by the threads
// from a shared counter.
#include "attention/flash_softmax.h"
#include "common/ops.h"
#include "common/vec.h"

#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <vector>

namespace kvserve {
namespace {

#ifdef KVSERVE_FLASH_PREFILL
using flash::BF16;
using flash::first_lanes;
constexpr int kBK = 256;       // keys per GEMM block
constexpr int kKeyAlign = 32;  // a block's keys are padded (masked) to a multiple of this
constexpr int kRowAlign = 8;   // a task's query tokens are a multiple of this (fewer distinct GEMM shapes)
constexpr float kLog2e = 1.4426950408889634f;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct Seq {
  int64_t first, rows, ctx, table;  // seq_info's row
  int64_t lo;                       // its first key any row sees (its first row's window start; else 0)
  int64_t keys;                     // ctx padded to kKeyAlign
  int64_t chunks;                   // its first entry in chunk_: kv head-major, then kBK-key blocks
  int64_t bq;                       // query tokens per task: its rows in even parts of at most max_bq_
};

struct Task {
  int32_t seq, head, block;  // block: the task's first query token / bq
  int64_t cost;
};

class FlashPrefill {
 public:
  FlashPrefill(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const at::Tensor& block_tables, const at::Tensor& seq_info, int64_t block_size, double scale,
               int64_t window, double softcap)
      : q_bf16_(q.scalar_type() == at::kBFloat16), out_bf16_(out.scalar_type() == at::kBFloat16), q_(q.data_ptr()),
        out_(out.data_ptr()), q_stride_(q.stride(0)), kc_(k_cache.data_ptr<BF16>()), vc_(v_cache.data_ptr<BF16>()),
        tables_(block_tables.data_ptr<int32_t>()), bs_(block_size),
        sm_{static_cast<float>(scale) * kLog2e, static_cast<float>(scale), static_cast<float>(softcap), q.size(2)},
        window_(std::max<int64_t>(window, 0)) {
    heads_ = q.size(1);
    d_ = q.size(2);
    kv_heads_ = k_cache.size(1);
    group_ = heads_ / kv_heads_;
    max_bq_ = group_ <= 4 ? 64 : 32;
    const int64_t slots = k_cache.size(0), ntab = block_tables.numel(), T = q.size(0);
    const int32_t* info = seq_info.data_ptr<int32_t>();
    int64_t packed = 0;
    // a chunk of K and V per (kv head, kBK keys) whose cache rows differ from every earlier one's:
    // sequences that share a prefix (the same blocks in their tables) share its chunks
    std::map<std::vector<int64_t>, int64_t> seen;
    for (int64_t s = 0; s < seq_info.size(0); ++s) {
      const int64_t first = info[4 * s], rows = info[4 * s + 1], ctx = info[4 * s + 2], table = info[4 * s + 3];
      TORCH_CHECK(rows >= 1 && first >= 0 && first + rows <= T && ctx >= rows, "flash_prefill: bad seq_info row ", s);
      TORCH_CHECK(table >= 0 && table + (ctx + bs_ - 1) / bs_ <= ntab, "flash_prefill: sequence ", s,
                  "'s table runs past block_tables");
      const int64_t lo = key_start(ctx - rows);
      for (int64_t b = lo / bs_; b < (ctx + bs_ - 1) / bs_; ++b)
        TORCH_CHECK(tables_[table + b] >= 0 && (tables_[table + b] + 1) * bs_ <= slots,
                    "flash_prefill: a block index is outside the cache");
      const int64_t keys = round_up(ctx, kKeyAlign), parts = (rows + max_bq_ - 1) / max_bq_;
      const int64_t bq = std::min(max_bq_, round_up((rows + parts - 1) / parts, kRowAlign));
      seqs_.push_back({first, rows, ctx, table, lo, keys, static_cast<int64_t>(chunk_.size()), bq});
      for (int64_t h = 0; h < kv_heads_; ++h)
        for (int64_t j0 = 0; j0 < keys; j0 += kBK) {
          const int64_t j1 = std::min(j0 + kBK, keys), valid = std::min(j1, ctx), from = std::max(j0, lo);
          if (j1 <= lo) {  // before every row's window: never packed nor read
            chunk_.push_back(-1);
            continue;
          }
          std::vector<int64_t> id = {h, j0, j1, valid, from};  // the rows' blocks and where the keys start and stop
          for (int64_t b = from / bs_; b <= (valid - 1) / bs_; ++b) id.push_back(tables_[table + b]);
          const auto [it, fresh] = seen.try_emplace(std::move(id), packed);
          if (fresh) {
            items_.push_back({s, h, j0, packed});
            packed += 2 * kBK * d_;  // K, then V
          }
          chunk_.push_back(it->second);
        }
      for (int64_t h = 0; h < kv_heads_; ++h)
        for (int64_t i0 = 0; i0 < rows; i0 += bq)
          tasks_.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h), static_cast<int32_t>(i0 / bq),
                            ctx - rows + std::min(i0 + bq, rows) - first_key(ctx - rows + i0)});
    }
    std::stable_sort(tasks_.begin(), tasks_.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
    packed_ = at::empty({packed}, q.options().dtype(at::kBFloat16));
  }

  void run() {
    at::parallel_for(0, static_cast<int64_t>(items_.size()), 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) pack(items_[i][0], items_[i][1], items_[i][2], items_[i][3]);
    });
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      Scratch& sc = tl_scratch;
      sc.fit(max_bq_ * group_, d_);
      for (int64_t t; (t = next.fetch_add(1)) < static_cast<int64_t>(tasks_.size());) attend(tasks_[t], sc);
      at::native::cpublas::brgemm_release(true);
    });
  }

 private:
  // A thread's buffers for m task rows of d: kept between calls and only grown (as paged_attention's),
  // so a call neither allocates nor zeroes them; attend() writes every part it reads.
  struct Scratch {
    std::vector<BF16> q, p;
    std::vector<float> s, o, mx, l;  // l: 16 lanes per row
    void fit(int64_t m, int64_t d) {
      if (static_cast<int64_t>(mx.size()) < m) mx.resize(m), l.resize(16 * m), p.resize(m * kBK), s.resize(m * kBK);
      if (static_cast<int64_t>(q.size()) < m * d) q.resize(m * d), o.resize(m * d);
    }
  };
  static inline thread_local Scratch tl_scratch;

  // the first key a row at position pos sees
  int64_t key_start(int64_t pos) const { return window_ > 0 ? std::max<int64_t>(0, pos - window_ + 1) : 0; }
  // the first key of the kBK-key block holding that
  int64_t first_key(int64_t pos) const { return key_start(pos) / kBK * kBK; }

  // (s, h)'s chunk of keys [j0, j0 + kBK): K then V
  BF16* chunk(const Seq& s, int64_t h, int64_t j0) const {
    return packed_.data_ptr<BF16>() + chunk_[s.chunks + h * ((s.keys + kBK - 1) / kBK) + j0 / kBK];
  }
  const BF16* key_row(const BF16* cache, const Seq& s, int64_t h, int64_t j) const {
    return cache + ((tables_[s.table + j / bs_] * bs_ + j % bs_) * kv_heads_ + h) * d_;
  }

  // keys [j0, j0 + kBK) of (s, h) into the chunk at `at`: K as [d / 2][kBK][2] (K^T in bf16 pairs
  // along d), V as [kBK / 2][d][2] (pairs of consecutive keys); keys past the context, or before the
  // sequence's first key s.lo, are zeros.
  void pack(int64_t si, int64_t h, int64_t j0, int64_t at) const {
    const Seq& s = seqs_[si];
    const int64_t j1 = std::min(j0 + kBK, s.keys), pairs = d_ / 2;
    auto live = [&](int64_t j) { return j >= s.lo && j < s.ctx; };
    uint32_t* kt = reinterpret_cast<uint32_t*>(packed_.data_ptr<BF16>() + at);
    for (int64_t j = j0; j < j1; j += 16) {  // 16 keys' rows gathered a bf16 pair at a time
      int64_t off[16];
      for (int k = 0; k < 16; ++k)
        off[k] = live(j + k) ? (key_row(kc_, s, h, j + k) - kc_) * static_cast<int64_t>(sizeof(BF16)) : 0;
      const __mmask16 keys = static_cast<__mmask16>(first_lanes(s.ctx - j) & ~first_lanes(s.lo - j));
      const __mmask8 lo8 = static_cast<__mmask8>(keys & 0xFF), hi8 = static_cast<__mmask8>(keys >> 8);
      const __m512i o0 = _mm512_loadu_si512(off), o1 = _mm512_loadu_si512(off + 8);
      for (int64_t p = 0; p < pairs; ++p) {
        const char* base = reinterpret_cast<const char*>(kc_) + 4 * p;
        const __m256i a = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), lo8, o0, base, 1);
        const __m256i b = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), hi8, o1, base, 1);
        _mm512_storeu_si512(kt + p * kBK + (j - j0), _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
      }
    }
    static const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                               6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    static const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    BF16* vp = packed_.data_ptr<BF16>() + at + kBK * d_;
    for (int64_t j = j0; j < j1; j += 2) {
      BF16* dst = vp + (j - j0) * d_;  // ((j - j0) / 2) * d pairs of 2
      for (int64_t c = 0; c < d_; c += 32) {
        const __m512i a = live(j) ? _mm512_loadu_si512(key_row(vc_, s, h, j) + c) : _mm512_setzero_si512();
        const __m512i b = live(j + 1) ? _mm512_loadu_si512(key_row(vc_, s, h, j + 1) + c) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi16(a, lo, b));
        _mm512_storeu_si512(dst + 2 * c + 32, _mm512_permutex2var_epi16(a, hi, b));
      }
    }
  }

  void attend(const Task& t, Scratch& sc) const {
    const Seq& s = seqs_[t.seq];
    const int64_t i0 = static_cast<int64_t>(t.block) * s.bq, nq = std::min(s.bq, s.rows - i0);
    const int64_t start = s.ctx - s.rows, kend = start + i0 + nq, G = group_, d = d_, m = s.bq * G;
    // the task's rows, token-major: row i * G + g is token i0 + i of query head h * G + g
    for (int64_t i = 0; i < s.bq; ++i)
      for (int64_t g = 0; g < G; ++g) {
        BF16* dst = sc.q.data() + (i * G + g) * d;
        if (i >= nq) {
          std::fill(dst, dst + d, BF16(0.f));
          continue;
        }
        const int64_t off = (s.first + i0 + i) * q_stride_ + (t.head * G + g) * d;
        if (q_bf16_) {
          std::copy_n(static_cast<const BF16*>(q_) + off, d, dst);
        } else {
          const float* src = static_cast<const float*>(q_) + off;
          for (int64_t c = 0; c < d; c += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + c)));
        }
      }
    std::fill_n(sc.mx.begin(), m, -std::numeric_limits<float>::infinity());
    std::fill_n(sc.l.begin(), 16 * m, 0.f);
    const int64_t jfirst = first_key(start + i0);  // the block of keys holding the first row's window start
    for (int64_t j0 = jfirst; j0 < kend; j0 += kBK) {
      const int64_t n = std::min<int64_t>(kBK, round_up(kend - j0, kKeyAlign));
      const BF16* kv = chunk(s, t.head, j0);
      at::native::cpublas::brgemm(m, n, d, d, kBK, kBK, false, sc.q.data(), kv, sc.s.data(), true);
      for (int64_t r = 0; r < nq * G; ++r) {  // padding rows: whatever p holds (finite), outputs dropped
        const int64_t pos = start + i0 + r / G;
        flash::softmax_block(sm_, sc.s.data() + r * kBK, sc.p.data() + r * kBK, n, key_start(pos) - j0, pos - j0 + 1,
                             sc.mx[r], sc.l.data() + 16 * r, sc.o.data() + r * d);
      }
      at::native::cpublas::brgemm(m, d, n, kBK, d, d, j0 > jfirst, sc.p.data(), kv + kBK * d, sc.o.data(), true);
    }
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = i * G + g, off = ((s.first + i0 + i) * heads_ + t.head * G + g) * d;
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(sc.l.data() + 16 * r)));
        const float* o = sc.o.data() + r * d;
        for (int64_t c = 0; c < d; c += 16) {
          const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(o + c), inv);
          if (out_bf16_)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<BF16*>(out_) + off + c), (__m256i)_mm512_cvtneps_pbh(y));
          else
            _mm512_storeu_ps(static_cast<float*>(out_) + off + c, y);
        }
      }
  }

  bool q_bf16_, out_bf16_;  // else float32
  const void* q_;
  void* out_;
  int64_t q_stride_;  // elements between q's tokens
  const BF16* kc_;
  const BF16* vc_;
  const int32_t* tables_;
  int64_t bs_;
  flash::SoftmaxScale sm_;  // scale * log2(e): scores go to the exp2 domain; the soft cap (> 0)
  int64_t window_;  // > 0: a row sees the window_ keys ending at its position
  int64_t heads_ = 0, d_ = 0, kv_heads_ = 0, group_ = 0, max_bq_ = 0;
  std::vector<Seq> seqs_;
  std::vector<Task> tasks_;
  std::vector<std::array<int64_t, 4>> items_;  // chunks to pack: (sequence, kv head, first key, offset)
  std::vector<int64_t> chunk_;                 // every (sequence, kv head, block)'s chunk offset
  at::Tensor packed_;
};
#endif

bool flash_prefill_available() {
#ifdef KVSERVE_FLASH_PREFILL
  return at::native::cpublas::could_pack(at::kBFloat16);
#else
  return false;
#endif
}

void flash_prefill(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_info, int64_t block_size, double scale,
                   int64_t window, double softcap) {
  TORCH_CHECK(flash_prefill_available(), "flash_prefill: this build or CPU has no bf16 brgemm (AMX)");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && out.sizes() == q.sizes() &&
                  out.is_contiguous(),
              "flash_prefill: q and out are [T, heads, d] of one shape, out contiguous, q's heads of one token adjacent");
  for (const at::Tensor* t : {&q, static_cast<const at::Tensor*>(&out)})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 || t->scalar_type() == at::kFloat,
                "flash_prefill: q and out are bfloat16 or float32");
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16 &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dim() == 3 && k_cache.size(2) == q.size(2),
              "flash_prefill: the caches are contiguous bfloat16 [slots, kv_heads, d] with q's d");
  TORCH_CHECK(q.size(2) % 32 == 0 && q.size(2) <= 256, "flash_prefill: head_dim must be a multiple of 32, at most 256");
  TORCH_CHECK(k_cache.size(1) > 0 && q.size(1) % k_cache.size(1) == 0, "flash_prefill: heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_info.scalar_type() == at::kInt && seq_info.dim() == 2 &&
                  seq_info.size(1) == 4 && block_tables.is_contiguous() && seq_info.is_contiguous(),
              "flash_prefill: block_tables int32 [N], seq_info int32 [S, 4]");
  TORCH_CHECK(block_size > 0, "flash_prefill: block_size must be positive");
  TORCH_CHECK(softcap >= 0, "flash_prefill: softcap must not be negative");
#ifdef KVSERVE_FLASH_PREFILL
  FlashPrefill(out, q, k_cache, v_cache, block_tables, seq_info, block_size, scale, window, softcap).run();
#endif
}

}  // namespace
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  // whether flash_prefill runs here: an AVX512-BF16 build over a torch whose brgemm does bf16 (AMX)
  m.def("flash_prefill_available() -> bool", &kvserve::flash_prefill_available);
  m.def("flash_prefill(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_info, int block_size, float scale, int window=0, float softcap=0.0) -> ()",
        &kvserve::flash_prefill);
}
