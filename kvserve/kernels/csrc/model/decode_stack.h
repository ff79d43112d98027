// kvserve.DecodeStack (decode_stack.cpp): every decoder layer of a Llama-family model for one step,
// in one call from Python. Its layers' weights and options, and the class torch registers; a step's
// work is decode_step.cpp's.
#pragma once
#include "common/ops.h"

#include <optional>
#include <string>
#include <vector>

#include <torch/custom_class.h>

namespace kvserve {

struct DecodeLayer {
  at::Tensor input_norm, post_norm;  // [hidden]
  at::Tensor qkv, o, gate_up, down;  // packed quantized weights (pack_quant)
  kvserve::PackedWeight qkv_w, o_w, gate_up_w, down_w;
  std::optional<at::Tensor> qkv_bias;  // Qwen2-style q/k/v bias
  std::optional<at::Tensor> q_norm, k_norm;  // Qwen3-style RMSNorm of each q and k head [head_dim], before rotary
  // the same weights in bf16, prepacked for oneDNN (mkldnn._reorder_linear_weight): AMX CPUs
  std::optional<at::Tensor> qkv_amx, o_amx, gate_up_amx, down_amx;
  // and packed for amx_linear (amx_gemm.cpp), which steps of up to kAmxLinearMaxRows rows take instead
  std::optional<at::Tensor> qkv_tiles, o_tiles, gate_up_tiles, down_tiles;
  int64_t window = 0;   // > 0: a sliding window (paged_attention's)
  double softcap = 0;   // > 0: a soft cap on the attention scores
};

struct DecodeStack : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim, hidden, intermediate;
  double eps;
  std::vector<DecodeLayer> layers;

  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t hidden, int64_t intermediate, double eps)
      : heads(heads), kv_heads(kv_heads), head_dim(head_dim), hidden(hidden), intermediate(intermediate), eps(eps) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, at::Tensor qkv, std::string qkv_kind,
                 std::optional<at::Tensor> qkv_bias, at::Tensor o, std::string o_kind, at::Tensor gate_up,
                 std::string gate_up_kind, at::Tensor down, std::string down_kind) {
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
    for (const at::Tensor* w : {&input_norm, &post_norm})
      TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->numel() == hidden,
                  "DecodeStack: float32 norm weights of the hidden size");
    if (qkv_bias)
      TORCH_CHECK(qkv_bias->scalar_type() == at::kFloat && qkv_bias->is_contiguous() &&
                      qkv_bias->numel() == q_size + 2 * kv_size, "DecodeStack: qkv bias float32 [q + 2 kv]");
    DecodeLayer L{input_norm, post_norm, qkv, o, gate_up, down,
            packed_weight(qkv, qkv_kind, q_size + 2 * kv_size, hidden), packed_weight(o, o_kind, hidden, q_size),
            packed_weight(gate_up, gate_up_kind, 2 * intermediate, hidden),
            packed_weight(down, down_kind, hidden, intermediate), qkv_bias};
    layers.push_back(std::move(L));
  }

  // DecodeLayer i's q and k heads normed (each head's head_dim values, the layers' eps) before rotary
  void set_qk_norm(int64_t i, at::Tensor q_norm, at::Tensor k_norm) {
    TORCH_CHECK(i >= 0 && i < num_layers(), "DecodeStack: no layer ", i);
    for (const at::Tensor* w : {&q_norm, &k_norm})
      TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->numel() == head_dim,
                  "DecodeStack: float32 q/k norm weights of head_dim");
    layers[i].q_norm = q_norm, layers[i].k_norm = k_norm;
  }

  // DecodeLayer i's attention options: a sliding window (> 0) and a soft cap on its scores (> 0), as the
  // paged kernel takes them (default none)
  void set_attention(int64_t i, int64_t window, double softcap) {
    TORCH_CHECK(i >= 0 && i < num_layers(), "DecodeStack: no layer ", i);
    TORCH_CHECK(softcap >= 0, "DecodeStack: a soft cap must not be negative");
    layers[i].window = std::max<int64_t>(window, 0), layers[i].softcap = softcap;
  }

  // DecodeLayer i's weights in bf16, prepacked for oneDNN: steps given amx_rows take them (forward)
  void add_amx_weights(int64_t i, at::Tensor qkv, at::Tensor o, at::Tensor gate_up, at::Tensor down) {
    TORCH_CHECK(i >= 0 && i < num_layers(), "DecodeStack: no layer ", i);
    DecodeLayer& L = layers[i];
    L.qkv_amx = qkv, L.o_amx = o, L.gate_up_amx = gate_up, L.down_amx = down;
  }

  // DecodeLayer i's weights packed by amx_pack: steps of up to kAmxLinearMaxRows rows take them over oneDNN's
  void add_tile_weights(int64_t i, at::Tensor qkv, at::Tensor o, at::Tensor gate_up, at::Tensor down) {
    TORCH_CHECK(i >= 0 && i < num_layers(), "DecodeStack: no layer ", i);
    DecodeLayer& L = layers[i];
    L.qkv_tiles = qkv, L.o_tiles = o, L.gate_up_tiles = gate_up, L.down_tiles = down;
  }

  bool has_tile_weights() const {
    return !layers.empty() &&
           std::all_of(layers.begin(), layers.end(), [](const DecodeLayer& L) { return L.qkv_tiles.has_value(); });
  }

  bool has_amx_weights() const {
    return !layers.empty() &&
           std::all_of(layers.begin(), layers.end(), [](const DecodeLayer& L) { return L.qkv_amx.has_value(); });
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  // h: float32 [T, hidden], the residual stream, updated in place through every layer.
  // k_caches/v_caches: per layer [slots, kv_heads, head_dim], float32 or 8-bit (int8, fp8) with
  // k_scales/v_scales per layer (float32 [kv_heads, head_dim]; empty lists for float32 caches);
  // slot_mapping: int64 [T], where each row's new key and value go; block_tables, seq_info: the
  // paged attention kernel's arguments.
  // amx_rows > 0 (at least T; every layer given add_amx_weights): the linears run in oneDNN's bf16
  // GEMM over that many rows (the rows past T zero), each between two OpenMP regions of the rest.
  void forward(at::Tensor h, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
               std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, std::vector<at::Tensor> k_scales,
               std::vector<at::Tensor> v_scales, const at::Tensor& slot_mapping,
               const at::Tensor& block_tables, const at::Tensor& seq_info, int64_t block_size, double scale,
               int64_t amx_rows);

 private:
  struct Step;  // one forward call (decode_step.cpp)

  void check_step(const at::Tensor& h, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                  const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                  const std::vector<at::Tensor>& k_scales, const std::vector<at::Tensor>& v_scales,
                  const at::Tensor& slot_mapping, int64_t amx_rows) const;

  // the quantized inputs of the linears, by input width; kept across steps (never shrink)
  QuantizedRows qa_hidden, qa_attn, qa_inter;
};

}  // namespace kvserve
