// y [M, N] = x [M, K] . W^T (+ bias) on AMX tiles, bf16 in and out, float32 sums: a decoder layer's
// linear over AMX_MIN_ROWS to kAmxLinearMaxRows rows (a decode step of up to 96 sequences;
// quant_linear.py), on CPUs with AMX-BF16. Any M works; the engine's choice is ops.h's. The panels and
// their products are amx_panels.h's; this file rounds each block to bf16 and writes it out.
//
// On our 2-core AMX Xeon, at 64 rows, it reads cold weights at ~17-20 GB/s where oneDNN's bf16 GEMM
// reads ~10-13 (the two cores read ~29 GB/s with tile loads alone: the products and the misses add
// up rather than overlap, as in the decode attention), and cache-hot weights 1.2-2x faster. From
// ~128 rows oneDNN catches up (our output writes and x's re-reads from L2 cost more per row: the
// writes are ~1/3 of the time at 2,048 rows), and it is faster for the LM head's 49k-wide output;
// those stay on oneDNN (scripts/amx_linear_bench.py; docs/benchmarks.md). The LM head's
// sampling rows go to amx_head.cpp, which writes no logits.
#include "gemm/amx_panels.h"
#include "common/ops.h"

namespace kvserve {
using namespace panels;
namespace {

#if defined(KVSERVE_AMX_TILES)
// y's rows of the block: sums + bias, rounded to bf16
void write_block(const Gemm& g, const float* bias, BF16* y, const Block& blk) {
  const int64_t n0 = blk.p * kPanel, cols = blk.cols(g), rows = blk.rows(g);
  const __mmask32 mask = cols == 32 ? ~__mmask32{0} : (__mmask32{1} << cols) - 1;
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    b0 = _mm512_maskz_loadu_ps(static_cast<__mmask16>(mask), bias + n0);
    b1 = _mm512_maskz_loadu_ps(static_cast<__mmask16>(mask >> 16), bias + n0 + 16);
  }
  for (int64_t i = 0; i < rows; ++i) {
    const __m512 lo = _mm512_add_ps(_mm512_load_ps(blk.c + i * 32), b0);
    const __m512 hi = _mm512_add_ps(_mm512_load_ps(blk.c + i * 32 + 16), b1);
    const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // round to nearest even
    _mm512_mask_storeu_epi16(y + (blk.r + i) * g.N + n0, mask, v);
  }
}
#endif

}  // namespace

bool amx_gemm_available() { return amx::kBuilt && amx::ready(); }

at::Tensor amx_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu(), "amx_pack: w must be a 2-D CPU tensor");
  const int64_t N = w.size(0), K = w.size(1), P = num_panels(N);
  TORCH_CHECK(K % kStep == 0, "amx_pack: K (", K, ") must be a multiple of ", kStep);
  at::Tensor padded = at::zeros({P * kPanel, K}, w.options().dtype(at::kBFloat16));
  padded.narrow(0, 0, N).copy_(w);
  // [panel, 2 tiles, 16 columns, K/32 steps, 16 pairs, 2] -> [panel, step, tile, pair, column, 2]
  return padded.view({P, 2, 16, K / kStep, 16, 2}).permute({0, 3, 1, 4, 2, 5}).contiguous();
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_gemm_available(), "amx_linear: this build or CPU has no AMX-BF16 tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "amx_linear: x must be a 2-D bfloat16 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(holds_panels(packed, n, K),
              "amx_linear: packed does not hold an amx_pack'ed [", n, ", ", K, "] weight");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n),
              "amx_linear: bias must be float32 [", n, "]");
  at::Tensor y = at::empty({M, n}, x.options());
#if defined(KVSERVE_AMX_TILES)
  if (M == 0 || n == 0) return y;
  const at::Tensor xc = x.contiguous();
  const Gemm g{xc.data_ptr<BF16>(), packed.data_ptr<BF16>(), M, n, K};
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  BF16* yp = y.data_ptr<BF16>();
  for_each_block(g, [&](const Block& blk) { write_block(g, b, yp, blk); });
#endif
  return y;
}

}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("amx_gemm_available() -> bool", &kvserve::amx_gemm_available);
  m.def("amx_linear_max_rows() -> int", [] { return kvserve::kAmxLinearMaxRows; });
  m.def("amx_pack(Tensor w) -> Tensor", &kvserve::amx_pack);
  m.def("amx_linear(Tensor x, Tensor packed, int n, Tensor? bias=None) -> Tensor", &kvserve::amx_linear);
}
