// kvserve::lora_apply_: a step's LoRA for one linear, every adapter at once (punica's shrink and expand),
// float32. For entry i of `order` (a row of x and y) and its slot s = slot_of[i] (entries of one slot
// consecutive): y[row] += (x[row] @ A[s]^T) @ B[s], where A: [S, K, in] and B: [S, K, Wb] holds row k's
// non-zero outputs, which land in y's columns [bounds[s][k][0], bounds[s][k][1]) (a fused linear's part).
// Rows of one slot go in tiles of up to kTile, so each row of A and B is read once per tile.
#include "common/ops.h"
#include "common/vec.h"

#include <vector>

namespace kvserve {
namespace {

constexpr int kTile = 4;

struct Tables {
  const float* a;
  const float* b;
  const int32_t* bounds;
  int64_t k, in, wb;
};

// t[r * K + k] = x_r . A[k] for the tile's rows, where row k is in use (bounds non-empty)
void shrink_tile(const float* const* xr, int nr, const Tables& tb, const int32_t* bounds, const float* a, float* t) {
  for (int64_t k = 0; k < tb.k; ++k) {
    if (bounds[2 * k] == bounds[2 * k + 1]) continue;
    const float* ak = a + k * tb.in;
    float sum[kTile] = {0.f, 0.f, 0.f, 0.f};
    int64_t j = 0;
#if defined(__AVX2__) || defined(__AVX512F__)
    using namespace vec;
    vf acc[kTile] = {vzero(), vzero(), vzero(), vzero()};
    for (; j + W <= tb.in; j += W) {
      const vf av = vload(ak + j);
      for (int r = 0; r < nr; ++r) acc[r] = vfma(vload(xr[r] + j), av, acc[r]);
    }
    for (int r = 0; r < nr; ++r) sum[r] = vsum(acc[r]);
#endif
    for (; j < tb.in; ++j)
      for (int r = 0; r < nr; ++r) sum[r] += xr[r][j] * ak[j];
    for (int r = 0; r < nr; ++r) t[r * tb.k + k] = sum[r];
  }
}

// y_r[lo:hi] += t[r * K + k] * B[k][:hi - lo] for every row k in use
void expand_tile(float* const* yr, int nr, const Tables& tb, const int32_t* bounds, const float* b, const float* t) {
  for (int64_t k = 0; k < tb.k; ++k) {
    const int64_t lo = bounds[2 * k], n = bounds[2 * k + 1] - lo;
    if (n == 0) continue;
    const float* bk = b + k * tb.wb;
    for (int r = 0; r < nr; ++r) {
      float* y = yr[r] + lo;
      const float s = t[r * tb.k + k];
      int64_t j = 0;
#if defined(__AVX2__) || defined(__AVX512F__)
      using namespace vec;
      const vf sv = vset1(s);
      for (; j + W <= n; j += W) vstore(y + j, vfma(sv, vload(bk + j), vload(y + j)));
#endif
      for (; j < n; ++j) y[j] += s * bk[j];
    }
  }
}

}  // namespace

void lora_apply_(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& bounds,
                 const at::Tensor& order, const at::Tensor& slot_of) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat &&
              b.scalar_type() == at::kFloat, "lora_apply_: float32 tensors");
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.stride(1) == 1 && x.stride(1) == 1, "lora_apply_: [T, n] row-major");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.is_contiguous() && b.is_contiguous() && bounds.is_contiguous() &&
              a.size(2) == x.size(1) && b.size(1) == a.size(1) && bounds.size(1) == a.size(1), "lora_apply_: tables");
  TORCH_CHECK(order.scalar_type() == at::kLong && slot_of.scalar_type() == at::kInt && order.numel() == slot_of.numel(),
              "lora_apply_: order int64, slot_of int32, one slot per entry");
  const Tables tb{a.data_ptr<float>(), b.data_ptr<float>(), bounds.data_ptr<int32_t>(), a.size(1), a.size(2), b.size(2)};
  const int64_t n = order.numel();
  const int64_t* rows = order.data_ptr<int64_t>();
  const int32_t* slots = slot_of.data_ptr<int32_t>();
  std::vector<int64_t> tiles;  // first entry of each tile: one slot, at most kTile rows
  for (int64_t i = 0; i < n; ++i)
    if (tiles.empty() || slots[i] != slots[tiles.back()] || i - tiles.back() == kTile) tiles.push_back(i);
  tiles.push_back(n);
  float* yp = y.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const int64_t ys = y.stride(0), xs = x.stride(0);
  at::parallel_for(0, static_cast<int64_t>(tiles.size()) - 1, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> t(kTile * tb.k);
    for (int64_t ti = t0; ti < t1; ++ti) {
      const int64_t first = tiles[ti];
      const int nr = static_cast<int>(tiles[ti + 1] - first);
      const int64_t s = slots[first];
      const float* xr[kTile];
      float* yr[kTile];
      for (int r = 0; r < nr; ++r) {
        xr[r] = xp + rows[first + r] * xs;
        yr[r] = yp + rows[first + r] * ys;
      }
      const int32_t* bd = tb.bounds + s * tb.k * 2;
      shrink_tile(xr, nr, tb, bd, tb.a + s * tb.k * tb.in, t.data());
      expand_tile(yr, nr, tb, bd, tb.b + s * tb.k * tb.wb, t.data());
    }
  });
}

}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("lora_apply_(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor bounds, Tensor order, Tensor slot_of) -> ()",
        &kvserve::lora_apply_);
}
