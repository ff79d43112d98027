// Dequantize Q8_0 / Q4_1 weights (the layout of kvserve/model/quant.py) to float32, in parallel.
// Prefill steps of hundreds of rows are compute bound: there a dequantized tile and oneDNN/MKL's
// GEMM beat the integer-dot kernels, and this makes the dequantization cost ~1% of the GEMM.
#include "common.h"

namespace {

constexpr int64_t QK = 32;

at::Tensor dequantize_q(const at::Tensor& qs, const at::Tensor& d, const c10::optional<at::Tensor>& m) {
  const bool q4 = m.has_value();
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous(), "qs: contiguous [N, K] (q8_0) or [N, K/2] (q4_1)");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous(), "d: fp16 [N, K/32]");
  const int64_t n = qs.size(0), k = q4 ? qs.size(1) * 2 : qs.size(1), nb = k / QK;
  TORCH_CHECK(k % QK == 0 && d.numel() == n * nb, "d: fp16 [N, K/32]");
  if (q4) TORCH_CHECK(m->scalar_type() == at::kHalf && m->is_contiguous() && m->numel() == n * nb, "m: fp16 [N, K/32]");
  auto out = at::empty({n, k}, at::TensorOptions().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const at::Half* dp = d.data_ptr<at::Half>();
  const at::Half* mp = q4 ? m->data_ptr<at::Half>() : nullptr;
  const uint8_t* u = q4 ? qs.data_ptr<uint8_t>() : nullptr;
  const int8_t* s = q4 ? nullptr : qs.data_ptr<int8_t>();
  at::parallel_for(0, n * nb, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float scale = static_cast<float>(dp[b]);
      float* ob = o + b * QK;
      if (q4) {
        const float mn = static_cast<float>(mp[b]);
        const uint8_t* ub = u + b * (QK / 2);
        for (int64_t j = 0; j < QK / 2; ++j) {
          ob[j] = scale * static_cast<float>(ub[j] & 0x0F) + mn;
          ob[j + QK / 2] = scale * static_cast<float>(ub[j] >> 4) + mn;
        }
      } else {
        const int8_t* sb = s + b * QK;
        for (int64_t j = 0; j < QK; ++j) ob[j] = scale * static_cast<float>(sb[j]);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("dequantize_q(Tensor qs, Tensor d, Tensor? m) -> Tensor", &dequantize_q);
}
