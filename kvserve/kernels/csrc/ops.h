// The kernels' C++ entry points (each also registered as a torch.ops.kvserve op), for kernels that
// compose them without a round trip through Python: decode_stack.cpp.
#pragma once
#include "common.h"

#include <string>

namespace kvserve {

// fused_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& w, double eps);
void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gu);

// quant_gemm.cpp
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::string& kind, int64_t n);

// paged_attention.cpp
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_info, int64_t block_size, double scale);

}  // namespace kvserve
