// The kernels' C++ entry points (each also registered as a torch.ops.kvserve op), for kernels that
// compose them without a round trip through Python: model/decode_step.cpp.
#pragma once
#include "common/common.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace kvserve {

// model/: rms_norm.cpp, rotary.cpp, gated_mul.cpp, store_rows.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, std::optional<at::ScalarType> out_dtype,
                    int64_t out_rows);
at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& w, double eps,
                        std::optional<at::ScalarType> out_dtype, int64_t out_rows);
void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gu);
at::Tensor gelu_tanh_mul(const at::Tensor& gu);
void store_rows_(at::Tensor& cache, const at::Tensor& slots, const at::Tensor& x);

// common/huge_pages.cpp: zeroed bytes on 2 MB pages where the OS grants them
at::Tensor zeros_huge(int64_t bytes);

// gemm/quant_gemm.cpp
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::string& kind, int64_t n);

// Activations quantized per 32-block: q int8 [M, K]; per block [M, K/32]: d (scale), s (the block's
// float sum, Q4_1's min term) and qsum (the sum of its q, Q8_0's correction for w + 128 on VNNI).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> qsum;
  int64_t K = 0, nb = 0;
  void reserve(int64_t M, int64_t K);  // sized for M rows of K (never shrinks); sets K
};
// A weight packed by pack_quant: [n, k] in tiles of 8 output columns.
struct PackedWeight {
  const uint8_t* data;
  bool q4;   // q4_1 or q4_0, else q8_0
  bool min;  // q4_1's m (w = d q + m); q4_0 has none (w = d (q - 8))
  int64_t block_bytes;  // one block of a tile (gemm/quant_format.h)
  int64_t n, k;
};
PackedWeight packed_weight(const at::Tensor& packed, const std::string& kind, int64_t n, int64_t k);  // checked
inline int64_t num_tiles(int64_t n) { return (n + 7) / 8; }
void quantize_rows_range(const float* x, QuantizedRows& a, int64_t r0, int64_t r1);  // rows of x [M, a.K]
class StreamPrefetch;
// y [M, w.n] = rows [a_row0, a_row0 + M) of a times w^T: output tiles [t0, t1). Given `pf`, the
// prefetch goes on from where an earlier call ended (tiles [.., t0) of the same weight), or starts.
void linear_tiles_range(const PackedWeight& w, const QuantizedRows& a, int64_t M, float* y, int64_t t0, int64_t t1,
                        int64_t a_row0 = 0, StreamPrefetch* pf = nullptr);
// the bytes of one tile of w (8 output columns, every block along K)
inline int64_t tile_bytes(const PackedWeight& w) { return w.k / 32 * w.block_bytes; }

// the same ops over float32 rows [r0, r1) on the calling thread
namespace rows {
void rms_norm(const float* x, const float* w, float* out, int64_t h, float eps, int64_t r0, int64_t r1);
void rotary(float* x, int64_t heads, int64_t d, int64_t row_stride, const int64_t* pos, const float* cos,
            const float* sin, int64_t r0, int64_t r1);
void silu_mul(const float* gu, float* out, int64_t inter, int64_t r0, int64_t r1);
// bf16 [r, 2 * inter] -> bf16 [r, inter], silu rounded to bf16 before the product (as torch does)
void silu_mul_bf16(const c10::BFloat16* gu, c10::BFloat16* out, int64_t inter, int64_t r0, int64_t r1);
// the same with GELU-tanh for SiLU (gelu_pytorch_tanh)
void gelu_tanh_mul(const float* gu, float* out, int64_t inter, int64_t r0, int64_t r1);
void gelu_tanh_mul_bf16(const c10::BFloat16* gu, c10::BFloat16* out, int64_t inter, int64_t r0, int64_t r1);
}  // namespace rows

// gemm/amx_gemm.cpp: y [M, n] = x [M, K] . W^T (+ bias), bf16, W as amx_pack packed it; AMX CPUs only.
// The engine calls it for up to kAmxLinearMaxRows rows, where it measured faster than oneDNN's GEMM
// (scripts/amx_linear_bench.py: about even at 128 rows, behind from 192; docs/benchmarks.md).
constexpr int64_t kAmxLinearMaxRows = 96;
bool amx_gemm_available();
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias);
// sampling/amx_head.cpp: per row of x, the token of greedy decoding (inv_temp 0) or of a plain-temperature
// draw with u, from the logits x . W^T, W an amx_pack'ed LM head, without writing the logits
at::Tensor amx_head_sample(const at::Tensor& x, const at::Tensor& packed, int64_t n, const at::Tensor& inv_temp,
                           const at::Tensor& u);

// attention/paged_attention.cpp (the plan) and paged_items.cpp (its work)
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_info, int64_t block_size, double scale,
                     const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                     int64_t window = 0, double softcap = 0, const std::optional<at::Tensor>& sinks = std::nullopt,
                     bool invariant = false);
// An 8-bit cache (int8, fp8) needs float32 [kv_heads, d] scales for K and V; a float cache none.
void check_kv_scales(const at::Tensor& cache, const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale);

// One step's paged attention cut into work: built (and every index checked) once, then run for any
// layer's q, out and caches of the same shapes. Chunks (one per thread) may run concurrently; the
// merges of split decodes run after every chunk is done. An 8-bit cache's scales (float32
// [kv_heads, d], checked by check_kv_scales) go with each run; null for a float cache. window > 0: each
// row attends its last `window` keys (the table's entries before them are never read); softcap > 0:
// scores capped as softcap * tanh(score / softcap). invariant: a decode over a bf16 cache takes the arithmetic
// of multi-token rows (bf16 pair products or AMX tiles otherwise), so a token's result never depends on
// whether it was decoded, verified or prefilled (float and 8-bit caches have one path already).
class PagedAttentionPlan {
 public:
  PagedAttentionPlan(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_info, int64_t block_size, double scale,
                     int64_t threads, int64_t window = 0, double softcap = 0, bool invariant = false);
  int64_t num_chunks() const;
  int64_t num_merges() const;
  void run_chunk(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 int64_t c, const float* k_scale = nullptr, const float* v_scale = nullptr,
                 const float* sinks = nullptr) const;
  void run_merges(const at::Tensor& out, int64_t begin, int64_t end, const float* v_scale = nullptr,
                  const float* sinks = nullptr) const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace kvserve
