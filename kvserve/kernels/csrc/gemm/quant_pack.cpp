// kvserve::pack_quant and kvserve::dequantize_packed: a weight in the layout of kvserve/model/quant.py
// to the packed layout the quantized linears read (quant_format.h), and back to float32.
#include "common/ops.h"
#include "gemm/quant_format.h"

#include <cstring>

namespace kvserve {
namespace {

using namespace quant;

at::Tensor pack_quant(const at::Tensor& qs, const at::Tensor& d, const c10::optional<at::Tensor>& m) {
  // uint8 nibbles: q4_1 with m, q4_0 without; int8: q8_0
  const bool q4 = qs.scalar_type() == at::kByte, min = m.has_value();
  const Format f = format_of(kind_of(q4, min));
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.device().is_cpu(), "pack_quant: qs contiguous [N, K(/2)] on CPU");
  TORCH_CHECK(q4 || (qs.scalar_type() == at::kChar && !min), "pack_quant: qs is uint8 (q4_1 with m, q4_0 without) or int8 (q8_0)");
  const int64_t n = qs.size(0), k = q4 ? qs.size(1) * 2 : qs.size(1), nb = k / QK;
  TORCH_CHECK(k % QK == 0, "pack_quant: K (", k, ") must be a multiple of 32");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.numel() == n * nb, "pack_quant: d fp16 [N, K/32]");
  if (min) TORCH_CHECK(m->scalar_type() == at::kHalf && m->is_contiguous() && m->numel() == n * nb, "pack_quant: m fp16 [N, K/32]");
  const int64_t tiles = (n + NR - 1) / NR;
  at::Tensor packed = zeros_huge(tiles * nb * f.block_bytes);  // padding columns: zeros
  uint8_t* out = packed.data_ptr<uint8_t>();
  const uint8_t* src = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr());
  const uint16_t* mp = min ? reinterpret_cast<const uint16_t*>(m->data_ptr()) : nullptr;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* blk = out + (t * nb + b) * f.block_bytes;
        uint16_t* scales = reinterpret_cast<uint16_t*>(blk + NR * f.q_bytes);
        for (int64_t j = 0; j < NR && t * NR + j < n; ++j) {
          const int64_t col = t * NR + j;
          const uint8_t* q = src + (col * nb + b) * f.q_bytes;
          if (q4) std::memcpy(blk + q4_column_slot(j) * f.q_bytes, q, f.q_bytes);
          else for (int64_t i = 0; i < QK; ++i) blk[q8_offset(j, i)] = q[i];
          scales[j] = dp[col * nb + b];
          if (min) scales[NR + j] = mp[col * nb + b];
        }
      }
  });
  return packed;
}

at::Tensor dequantize_packed(const at::Tensor& packed, const std::string& kind, int64_t n, int64_t k) {
  const Format f = format_of(kind);
  const int64_t nb = k / QK, tiles = (n + NR - 1) / NR;
  TORCH_CHECK(k % QK == 0 && packed.numel() == tiles * nb * f.block_bytes && packed.is_contiguous(),
              "dequantize_packed: packed does not hold a [", n, ", ", k, "] ", kind, " weight");
  at::Tensor out = at::empty({n, k}, at::TensorOptions().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const uint8_t* p = packed.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = p + (t * nb + b) * f.block_bytes;
        const uint16_t* scales = reinterpret_cast<const uint16_t*>(blk + NR * f.q_bytes);
        for (int64_t j = 0; j < NR && t * NR + j < n; ++j) {
          const float dw = half_to_float(scales[j]);
          float* row = o + (t * NR + j) * k + b * QK;
          if (f.q4) {
            const uint8_t* q = blk + q4_column_slot(j) * f.q_bytes;
            if (f.min) {
              const float mw = half_to_float(scales[NR + j]);
              for (int64_t i = 0; i < QK / 2; ++i) {
                row[i] = dw * static_cast<float>(q[i] & 0x0F) + mw;
                row[i + QK / 2] = dw * static_cast<float>(q[i] >> 4) + mw;
              }
            } else {
              for (int64_t i = 0; i < QK / 2; ++i) {
                row[i] = dw * static_cast<float>((q[i] & 0x0F) - 8);
                row[i + QK / 2] = dw * static_cast<float>((q[i] >> 4) - 8);
              }
            }
          } else {
            for (int64_t i = 0; i < QK; ++i) row[i] = dw * static_cast<float>(static_cast<int8_t>(blk[q8_offset(j, i)]));
          }
        }
      }
  });
  return out;
}

}  // namespace
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("pack_quant(Tensor qs, Tensor d, Tensor? m) -> Tensor", &kvserve::pack_quant);
  m.def("dequantize_packed(Tensor packed, str kind, int n, int k) -> Tensor", &kvserve::dequantize_packed);
}
