// kvserve::store_rows_: a step's new K or V rows into the paged cache at their slots.
#include "common/ops.h"
#include "common/rows.h"

#include <cstring>

namespace kvserve {

// cache[slots[t]] = x[t] for each row t: the KV write of a step's new tokens. x's rows may be strided
// (k and v are views of the fused qkv output) but each row's [heads, d] is contiguous: one copy a row,
// rows split across threads. torch's index_copy_ took ~2% of an AMX prefill for these few bytes.
void store_rows_(at::Tensor& cache, const at::Tensor& slots, const at::Tensor& x) {
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous() && x.dim() == 3 && x.size(1) == cache.size(1) &&
                  x.size(2) == cache.size(2) && x.stride(2) == 1 && x.stride(1) == x.size(2) &&
                  x.scalar_type() == cache.scalar_type(),
              "store_rows_: cache [S, H, D] contiguous, x [T, H, D] of its dtype with contiguous rows");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() && slots.size(0) == x.size(0),
              "store_rows_: slots int64 [T]");
  const int64_t n = x.size(0), num_slots = cache.size(0), row_bytes = x.size(1) * x.size(2) * x.element_size();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "store_rows_: slot out of range");
  char* dst = static_cast<char*>(cache.data_ptr());
  const char* src = static_cast<const char*>(x.data_ptr());
  const int64_t src_stride = x.stride(0) * x.element_size();
  at::parallel_for(0, n, rowops::grain_rows(x.size(1) * x.size(2)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) std::memcpy(dst + sp[t] * row_bytes, src + t * src_stride, row_bytes);
  });
}

}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("store_rows_(Tensor(a!) cache, Tensor slots, Tensor x) -> ()", &kvserve::store_rows_);
}
