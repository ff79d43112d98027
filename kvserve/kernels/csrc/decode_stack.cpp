// kvserve.DecodeStack: every decoder layer of a Llama-family model for one step of rows that all
// read the paged KV cache (decodes, short chunks continuing a context), in one call from Python.
//
// A layer is ~12 small ops; from Python each costs a few microseconds of interpreter and dispatch
// on top of its work, which at decode sizes is most of the step: a single-stream token of the
// embedded 30-layer model spent ~3 ms of ~13 there. Here the same kernels (ops.h) run back to
// back, with the layer's weights held by the stack (built once at load). The maths is the Python
// layer's (kvserve/model/llama.py), op for op; tests check the two agree.
#include "ops.h"

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <torch/custom_class.h>

namespace {

struct Layer {
  at::Tensor input_norm, post_norm;    // [hidden]
  at::Tensor qkv, o, gate_up, down;    // packed quantized weights (pack_quant)
  std::string qkv_kind, o_kind, gate_up_kind, down_kind;
  std::optional<at::Tensor> qkv_bias;  // Qwen2-style q/k/v bias
};

// Rows [t] of src ([T, kv_heads * d] with row stride ``stride``) into cache slots ``slots[t]``.
void write_kv(at::Tensor& cache, const at::Tensor& src, const int64_t* slots, int64_t rows) {
  const int64_t width = cache.size(1) * cache.size(2), slots_n = cache.size(0);
  float* dst = cache.data_ptr<float>();
  const float* s = src.data_ptr<float>();
  const int64_t stride = src.stride(0);
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < slots_n, "DecodeStack: slot ", slots[t], " out of range");
    std::memcpy(dst + slots[t] * width, s + t * stride, width * sizeof(float));
  }
}

}  // namespace

namespace kvserve {

struct DecodeStack : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim, intermediate;
  double eps;
  std::vector<Layer> layers;

  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps)
      : heads(heads), kv_heads(kv_heads), head_dim(head_dim), intermediate(intermediate), eps(eps) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, at::Tensor qkv, std::string qkv_kind,
                 std::optional<at::Tensor> qkv_bias, at::Tensor o, std::string o_kind, at::Tensor gate_up,
                 std::string gate_up_kind, at::Tensor down, std::string down_kind) {
    TORCH_CHECK(input_norm.scalar_type() == at::kFloat && post_norm.scalar_type() == at::kFloat,
                "DecodeStack: float32 models only");
    layers.push_back({input_norm, post_norm, qkv, o, gate_up, down, qkv_kind, o_kind, gate_up_kind, down_kind, qkv_bias});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  // h: float32 [T, hidden], the residual stream, updated in place through every layer.
  // k_caches/v_caches: per layer [slots, kv_heads, head_dim]; slot_mapping: int64 [T], where each
  // row's new key and value go; block_tables, seq_info: the paged attention kernel's arguments.
  void forward(at::Tensor h, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
               std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, const at::Tensor& slot_mapping,
               const at::Tensor& block_tables, const at::Tensor& seq_info, int64_t block_size, double scale) {
    TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == at::kFloat, "DecodeStack: h float32 [T, hidden]");
    TORCH_CHECK(k_caches.size() == layers.size() && v_caches.size() == layers.size(), "DecodeStack: one K and V cache per layer");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == h.size(0),
                "DecodeStack: slot_mapping int64 [T]");
    const int64_t T = h.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& L = layers[i];
      at::Tensor& kc = k_caches[i];
      at::Tensor& vc = v_caches[i];
      TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.scalar_type() == at::kFloat && kc.size(1) == kv_heads &&
                      kc.size(2) == head_dim && vc.sizes() == kc.sizes(), "DecodeStack: caches float32 [slots, kv_heads, d]");
      // attention
      at::Tensor x = rms_norm(h, L.input_norm, eps);
      at::Tensor qkv = packed_linear(x, L.qkv, L.qkv_kind, q_size + 2 * kv_size);
      if (L.qkv_bias) qkv.add_(*L.qkv_bias);
      at::Tensor q = qkv.narrow(1, 0, q_size).view({T, heads, head_dim});
      at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, kv_heads, head_dim});
      rotary_(q, k, positions, cos, sin);
      write_kv(kc, qkv.narrow(1, q_size, kv_size), slots, T);
      write_kv(vc, qkv.narrow(1, q_size + kv_size, kv_size), slots, T);
      at::Tensor attn = at::empty({T, heads, head_dim}, h.options());
      paged_attention(attn, q, kc, vc, block_tables, seq_info, block_size, scale);
      at::Tensor o = packed_linear(attn.view({T, q_size}), L.o, L.o_kind, h.size(1));
      // MLP
      x = add_rms_norm(h, o, L.post_norm, eps);
      at::Tensor gu = packed_linear(x, L.gate_up, L.gate_up_kind, 2 * intermediate);
      h.add_(packed_linear(silu_mul(gu), L.down, L.down_kind, h.size(1)));
    }
  }
};

}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.class_<kvserve::DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double>())
      .def("add_layer", &kvserve::DecodeStack::add_layer)
      .def("num_layers", &kvserve::DecodeStack::num_layers)
      .def("forward", &kvserve::DecodeStack::forward);
}
