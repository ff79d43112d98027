// y [M, N] = x [M, K] . W^T (+ bias) on AMX tiles, bf16 in and out, float32 sums: a decoder layer's
// linear over AMX_MIN_ROWS to kAmxLinearMaxRows rows (a decode step of up to 96 sequences;
// quant_linear.py), on CPUs with AMX-BF16. Any M works; the engine's choice is ops.h's.
//
// With few rows, each weight takes part in few products and the time goes to reading the weights:
// ~200 MB of decoder weights a step for the embedded model in bf16, mostly from memory, since the
// step's K/V evicts them from the cache. This kernel is built around that stream:
//   - the weight is packed once into panels of 32 output columns (amx_pack), each panel one run of
//     the 16 x 32 B tiles in the order the products use them: a thread reads its panels front to
//     back, and the lines a few KB ahead are prefetched;
//   - four accumulator tiles hold a 32 x 32 block of y: per 32 inputs, two x tiles and two weight
//     tiles make four products. A panel is read from memory once, for its first 32 rows; the next
//     rows (up to kChunkRows) find it in L1/L2.
// On our 2-core AMX Xeon, at 64 rows, it reads cold weights at ~17-20 GB/s where oneDNN's bf16 GEMM
// reads ~10-13 (the two cores read ~29 GB/s with tile loads alone: the products and the misses add
// up rather than overlap, as in the decode attention), and cache-hot weights 1.2-2x faster. From
// ~128 rows oneDNN catches up (our output writes and x's re-reads from L2 cost more per row: the
// writes are ~1/3 of the time at 2,048 rows), and it is faster for the LM head's 49k-wide output;
// those stay on oneDNN (scripts/amx_linear_bench.py; docs/benchmarks.md, session 22).
#include "amx_tiles.h"
#include "ops.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace kvserve {
namespace {

constexpr int64_t kPanel = 32;        // output columns per panel: two 16-column tiles
constexpr int64_t kStep = 32;         // inputs per tile product (16 bf16 pairs)
constexpr int64_t kTile = 16 * 32;    // bf16 values in one B tile
constexpr int64_t kChunkRows = 256;   // rows of x that stay in L2 while the panels pass

int64_t num_panels(int64_t n) { return (n + kPanel - 1) / kPanel; }

#if defined(KVSERVE_AMX_TILES)
using BF16 = c10::BFloat16;
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of the products a panel is prefetched

struct Args {
  const BF16* x;       // [M, K]
  const BF16* w;       // amx_pack's panels
  const float* bias;   // [N] or null
  BF16* y;             // [M, N]
  int64_t M, N, K;
};

// A 32 x 32 block of y: rows [r, r + 32) by panel p's columns, summed in float32.
struct Block {
  alignas(64) float c[32 * 32];
  int64_t p = 0, r = 0;
};

// Issues the products of x's rows xr[0, 32) (32 rows, K apart) and one panel into tiles 4-7, then
// stores them to `out`. `stream`: this is the panel's first read, from memory, so the lines ahead
// are prefetched a few KB ahead (measured: to L2 instead, or further ahead, was slower).
void products(const Args& a, const BF16* xr, const BF16* panel, bool stream, Block& out) {
  const int64_t steps = a.K / kStep;
  const char* ahead = reinterpret_cast<const char*>(panel) + kPrefetchBytes;
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t s = 0; s < steps; ++s) {
    const BF16* b = panel + s * 2 * kTile;
    if (stream)
      for (int64_t i = 0; i < 2 * kTile * 2; i += 64) _mm_prefetch(ahead + s * 2 * kTile * 2 + i, _MM_HINT_T0);
    _tile_loadd(0, xr + s * kStep, a.K * 2);
    _tile_loadd(1, xr + 16 * a.K + s * kStep, a.K * 2);
    _tile_loadd(2, b, 64);
    _tile_loadd(3, b + kTile, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    _tile_dpbf16ps(6, 1, 2);
    _tile_dpbf16ps(7, 1, 3);
  }
  _tile_stored(4, out.c, 128);
  _tile_stored(5, out.c + 16, 128);
  _tile_stored(6, out.c + 16 * 32, 128);
  _tile_stored(7, out.c + 16 * 32 + 16, 128);
}

// y's rows [r, min(r + 32, M)) and the block's columns: sums + bias, rounded to bf16
void write_block(const Args& a, const Block& blk) {
  const int64_t n0 = blk.p * kPanel, cols = std::min(kPanel, a.N - n0), rows = std::min<int64_t>(32, a.M - blk.r);
  const __mmask32 mask = cols == 32 ? ~__mmask32{0} : (__mmask32{1} << cols) - 1;
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (a.bias != nullptr) {
    b0 = _mm512_maskz_loadu_ps(static_cast<__mmask16>(mask), a.bias + n0);
    b1 = _mm512_maskz_loadu_ps(static_cast<__mmask16>(mask >> 16), a.bias + n0 + 16);
  }
  for (int64_t i = 0; i < rows; ++i) {
    const __m512 lo = _mm512_add_ps(_mm512_load_ps(blk.c + i * 32), b0);
    const __m512 hi = _mm512_add_ps(_mm512_load_ps(blk.c + i * 32 + 16), b1);
    const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // round to nearest even
    _mm512_mask_storeu_epi16(a.y + (blk.r + i) * a.N + n0, mask, v);
  }
}

// panels [p0, p1) for every row, on the calling thread (tiles configured)
void run_panels(const Args& a, int64_t p0, int64_t p1) {
  const int64_t full = a.M / 32 * 32;  // rows in whole 32-row blocks; the rest from a padded copy
  std::vector<BF16> tail;
  if (full < a.M) {
    tail.assign(32 * a.K, BF16(0.f));
    std::memcpy(tail.data(), a.x + full * a.K, (a.M - full) * a.K * sizeof(BF16));
  }
  const int64_t panel_size = a.K / kStep * 2 * kTile;
  Block blk;
  for (int64_t c0 = 0; c0 < a.M; c0 += kChunkRows) {
    const int64_t c1 = std::min(a.M, c0 + kChunkRows);
    for (int64_t p = p0; p < p1; ++p) {
      const BF16* panel = a.w + p * panel_size;
      for (int64_t r = c0; r < c1; r += 32) {
        blk.p = p, blk.r = r;
        products(a, r >= full ? tail.data() : a.x + r * a.K, panel, r == c0, blk);
        write_block(a, blk);
      }
    }
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
  const int64_t M = x.size(0), K = x.size(1), P = num_panels(n);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && K % kStep == 0 &&
                  packed.numel() == P * kPanel * K,
              "amx_linear: packed does not hold an amx_pack'ed [", n, ", ", K, "] weight");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n),
              "amx_linear: bias must be float32 [", n, "]");
  at::Tensor y = at::empty({M, n}, x.options());
#if defined(KVSERVE_AMX_TILES)
  if (M == 0 || n == 0) return y;
  const at::Tensor xc = x.contiguous();
  const Args a{xc.data_ptr<BF16>(), packed.data_ptr<BF16>(), bias ? bias->data_ptr<float>() : nullptr,
               y.data_ptr<BF16>(), M, n, K};
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    amx::configure();
    run_panels(a, p0, p1);
    amx::release();
  });
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
