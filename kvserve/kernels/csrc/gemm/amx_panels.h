// The core that kvserve's AMX GEMMs share (amx_gemm.cpp's linear, amx_head.cpp's LM head that samples):
// a bf16 weight packed as panels of 32 output columns, and the tile products that make a 32 x 32
// block of float32 sums from one panel and 32 rows of x. What is done with a block (rounded and
// written out, or reduced to the few numbers sampling needs) is the caller's.
//
// With few rows, each weight takes part in few products and the time goes to reading the weights,
// mostly from memory, since a decode step's K/V evicts them from the cache. So:
//   - amx_pack lays each panel out as one run of its 16 x 32 B tiles in the order the products use
//     them: a thread reads its panels front to back, and the lines a few KB ahead are prefetched;
//   - four accumulator tiles hold a 32 x 32 block: per 32 inputs, two x tiles and two weight tiles
//     make four products. A panel is read from memory once, for its first 32 rows; the next rows
//     (up to kChunkRows) find it in L1/L2.
// A row's sums do not depend on the other rows: the same bits in any batch.
#pragma once
#include "common/amx_tiles.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace kvserve {
namespace panels {

constexpr int64_t kPanel = 32;        // output columns per panel: two 16-column tiles
constexpr int64_t kStep = 32;         // inputs per tile product (16 bf16 pairs)
constexpr int64_t kTile = 16 * 32;    // bf16 values in one B tile
constexpr int64_t kChunkRows = 256;   // rows of x that stay in L2 while the panels pass

inline int64_t num_panels(int64_t n) { return (n + kPanel - 1) / kPanel; }

// Whether `packed` holds an amx_pack'ed [n, K] weight.
inline bool holds_panels(const at::Tensor& packed, int64_t n, int64_t K) {
  return packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && K % kStep == 0 &&
         packed.numel() == num_panels(n) * kPanel * K;
}

#if defined(KVSERVE_AMX_TILES)
using BF16 = c10::BFloat16;
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of the products a panel is prefetched

struct Gemm {
  const BF16* x;  // [M, K]
  const BF16* w;  // amx_pack's panels
  int64_t M, N, K;
  int64_t panel_size() const { return K / kStep * 2 * kTile; }
};

// A 32 x 32 block of sums: rows [r, r + 32) by panel p's columns.
struct Block {
  alignas(64) float c[32 * 32];
  int64_t p = 0, r = 0;
  int64_t rows(const Gemm& g) const { return std::min<int64_t>(32, g.M - r); }
  int64_t cols(const Gemm& g) const { return std::min(kPanel, g.N - p * kPanel); }
};

// The products of x's rows xr[0, 32) (K apart) and one panel in tiles 4-7, stored to `out`.
// `stream`: this is the panel's first read, from memory, so the lines ahead are prefetched a few KB
// ahead (measured: to L2 instead, or further ahead, was slower).
inline void products(const Gemm& g, const BF16* xr, const BF16* panel, bool stream, Block& out) {
  const int64_t steps = g.K / kStep;
  const char* ahead = reinterpret_cast<const char*>(panel) + kPrefetchBytes;
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t s = 0; s < steps; ++s) {
    const BF16* b = panel + s * 2 * kTile;
    if (stream)
      for (int64_t i = 0; i < 2 * kTile * 2; i += 64) _mm_prefetch(ahead + s * 2 * kTile * 2 + i, _MM_HINT_T0);
    _tile_loadd(0, xr + s * kStep, g.K * 2);
    _tile_loadd(1, xr + 16 * g.K + s * kStep, g.K * 2);
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

// One row's 32 sums with panel p, the same bits as `products` gives that row: every row of the x
// tile reads the row (stride 0), and each accumulator sums in the same order. out: 16 x 32 floats,
// of which the first 32 are the row's.
inline void row_products(const Gemm& g, const BF16* x_row, int64_t p, float* out) {
  const BF16* panel = g.w + p * g.panel_size();
  _tile_zero(4);
  _tile_zero(5);
  for (int64_t s = 0; s < g.K / kStep; ++s) {
    const BF16* b = panel + s * 2 * kTile;
    _tile_loadd(0, x_row + s * kStep, 0);
    _tile_loadd(2, b, 64);
    _tile_loadd(3, b + kTile, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
  }
  _tile_stored(4, out, 128);
  _tile_stored(5, out + 16, 128);
}

// Panels [p0, p1) against every row of x, on the calling thread (tiles configured): `done(block)`
// for each 32 x 32 block, panel by panel within each chunk of kChunkRows rows.
template <typename Done>
void run_panels(const Gemm& g, int64_t p0, int64_t p1, Done&& done) {
  const int64_t full = g.M / 32 * 32;  // rows in whole 32-row blocks; the rest from a padded copy
  std::vector<BF16> tail;
  if (full < g.M) {
    tail.assign(32 * g.K, BF16(0.f));
    std::memcpy(tail.data(), g.x + full * g.K, (g.M - full) * g.K * sizeof(BF16));
  }
  Block blk;
  for (int64_t c0 = 0; c0 < g.M; c0 += kChunkRows) {
    const int64_t c1 = std::min(g.M, c0 + kChunkRows);
    for (int64_t p = p0; p < p1; ++p) {
      const BF16* panel = g.w + p * g.panel_size();
      for (int64_t r = c0; r < c1; r += 32) {
        blk.p = p, blk.r = r;
        products(g, r >= full ? tail.data() : g.x + r * g.K, panel, r == c0, blk);
        done(static_cast<const Block&>(blk));
      }
    }
  }
}

// Every block of the GEMM, the panels split across the threads (each configures its tiles first):
// `done(block)` runs on the thread that made the block.
template <typename Done>
void for_each_block(const Gemm& g, Done&& done) {
  at::parallel_for(0, num_panels(g.N), 1, [&](int64_t p0, int64_t p1) {
    amx::configure();
    run_panels(g, p0, p1, done);
    amx::release();
  });
}
#endif

}  // namespace panels
}  // namespace kvserve
