// kvserve.DecodeStack (decode_stack.cpp): every decoder layer of a model for one step, in one call
// from Python: Llama's layers and the options other architectures add to them. Its layers' weights
// and options, and the class torch registers; a step's work is decode_step.cpp's.
#pragma once
#include "common/ops.h"
#include "model/moe_block.h"

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include <torch/custom_class.h>

namespace kvserve {

// which rotary tables a layer's q and k rotate by: none (SmolLM3's NoPE layers), the model's, or the
// sliding layers' own (Gemma 3's local base)
enum class Rotary : int8_t { kNone, kGlobal, kLocal };
// a gated MLP's activation: act(gate) * up
enum class Activation : int8_t { kSilu, kGeluTanh };

// One decoder layer: its weights and options (its spec). Llama's is the default; the set_* calls add
// the options other architectures have, each read once per layer per step, never per row.
struct DecodeLayer {
  // the RMSNorms before attention and before the MLP [hidden] (weights with Gemma's 1 already added);
  // none in OLMo 2's post-norm layout, where each sublayer reads the residual stream itself
  std::optional<at::Tensor> input_norm, post_norm;
  at::Tensor qkv, o;  // packed quantized weights (pack_quant)
  std::optional<at::Tensor> gate_up, down;  // the dense MLP's (none in an MoE layer)
  kvserve::PackedWeight qkv_w, o_w, gate_up_w{}, down_w{};
  c10::intrusive_ptr<MoEBlock> moe;  // set: an MoE layer, whose MLP is this block (set_moe)
  std::optional<at::Tensor> qkv_bias;  // Qwen2-style q/k/v bias
  std::optional<at::Tensor> o_bias, gate_up_bias, down_bias;  // the other linears' biases (set_biases)
  // RMSNorms on attention's and the MLP's outputs before the residual add (Gemma's sandwich, OLMo 2's post)
  std::optional<at::Tensor> attn_out_norm, mlp_out_norm;
  // q/k RMSNorm before rotary: per head [head_dim] (Qwen3, Gemma 3) or over the projection [q], [kv] (OLMo 2)
  std::optional<at::Tensor> q_norm, k_norm;
  // the same weights in bf16, prepacked for oneDNN (mkldnn._reorder_linear_weight): AMX CPUs
  std::optional<at::Tensor> qkv_amx, o_amx, gate_up_amx, down_amx;
  // and packed for amx_linear (amx_gemm.cpp), which steps of up to kAmxLinearMaxRows rows take instead
  std::optional<at::Tensor> qkv_tiles, o_tiles, gate_up_tiles, down_tiles;
  int64_t window = 0;   // > 0: a sliding window (paged_attention's)
  double softcap = 0;   // > 0: a soft cap on the attention scores
  std::optional<at::Tensor> sinks;  // [heads]: a logit per query head in its softmax's denominator (gpt-oss)
  Rotary rotary = Rotary::kGlobal;
};

struct DecodeStack : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim, hidden, intermediate;
  double eps;
  std::vector<DecodeLayer> layers;
  Activation activation = Activation::kSilu;
  double residual_scale = 1;  // each sublayer's output times this before the residual add (Granite)
  bool invariant = false;     // the paged attention plans' (PagedAttentionPlan): no decode-only arithmetic

  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t hidden, int64_t intermediate, double eps)
      : heads(heads), kv_heads(kv_heads), head_dim(head_dim), hidden(hidden), intermediate(intermediate), eps(eps) {}

  // a layer of Llama's ops; input_norm and post_norm None: OLMo 2's layout (set_out_norms gives its norms);
  // gate_up and down None: an MoE layer (set_moe gives its MLP)
  void add_layer(std::optional<at::Tensor> input_norm, std::optional<at::Tensor> post_norm, at::Tensor qkv,
                 std::string qkv_kind, std::optional<at::Tensor> qkv_bias, at::Tensor o, std::string o_kind,
                 std::optional<at::Tensor> gate_up, std::string gate_up_kind, std::optional<at::Tensor> down,
                 std::string down_kind) {
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
    TORCH_CHECK(input_norm.has_value() == post_norm.has_value(), "DecodeStack: both pre-norms or neither");
    for (const auto* w : {&input_norm, &post_norm})
      if (*w) check_vector(**w, hidden, "norm weights of the hidden size");
    if (qkv_bias) check_vector(*qkv_bias, q_size + 2 * kv_size, "qkv bias [q + 2 kv]");
    DecodeLayer L;
    L.input_norm = input_norm, L.post_norm = post_norm, L.qkv_bias = qkv_bias;
    L.qkv = qkv, L.o = o, L.gate_up = gate_up, L.down = down;
    L.qkv_w = packed_weight(qkv, qkv_kind, q_size + 2 * kv_size, hidden);
    L.o_w = packed_weight(o, o_kind, hidden, q_size);
    TORCH_CHECK(gate_up.has_value() == down.has_value(), "DecodeStack: gate_up and down, or neither (MoE)");
    if (gate_up) {
      L.gate_up_w = packed_weight(*gate_up, gate_up_kind, 2 * intermediate, hidden);
      L.down_w = packed_weight(*down, down_kind, hidden, intermediate);
    }
    layers.push_back(std::move(L));
  }

  // DecodeLayer i's MLP: a mixture of experts (a layer added without gate_up and down); a kvserve.MoEBlock,
  // taken as any value: a typed argument would need MoEBlock registered first, and the files' order is the linker's
  void set_moe(int64_t i, c10::IValue block) {
    check_layer(i);
    TORCH_CHECK(block.isObject(), "DecodeStack: set_moe takes a kvserve.MoEBlock");
    c10::intrusive_ptr<MoEBlock> moe = block.toCustomClass<MoEBlock>();
    TORCH_CHECK(!layers[i].gate_up && moe->hidden == hidden, "DecodeStack: an MoE block of the hidden size, on a "
                "layer without a dense MLP");
    layers[i].moe = std::move(moe);
  }

  bool complete() const {  // every layer has its MLP
    return std::all_of(layers.begin(), layers.end(), [](const DecodeLayer& L) { return L.gate_up || L.moe; });
  }

  // DecodeLayer i's q and k normed before rotary (the layers' eps): each head's head_dim values (weights
  // [head_dim]), or each row's whole q and whole k (weights [heads * head_dim], [kv_heads * head_dim])
  void set_qk_norm(int64_t i, at::Tensor q_norm, at::Tensor k_norm) {
    check_layer(i);
    TORCH_CHECK((q_norm.numel() == head_dim && k_norm.numel() == head_dim) ||
                    (q_norm.numel() == heads * head_dim && k_norm.numel() == kv_heads * head_dim),
                "DecodeStack: q/k norm weights per head [head_dim] or over the projection [q], [kv]");
    check_vector(q_norm, q_norm.numel(), "q norm weights");
    check_vector(k_norm, k_norm.numel(), "k norm weights");
    layers[i].q_norm = q_norm, layers[i].k_norm = k_norm;
  }

  // DecodeLayer i's norms on attention's and the MLP's outputs, before each residual add
  void set_out_norms(int64_t i, at::Tensor attn_out_norm, at::Tensor mlp_out_norm) {
    check_layer(i);
    check_vector(attn_out_norm, hidden, "norm weights of the hidden size");
    check_vector(mlp_out_norm, hidden, "norm weights of the hidden size");
    layers[i].attn_out_norm = attn_out_norm, layers[i].mlp_out_norm = mlp_out_norm;
  }

  // DecodeLayer i's biases of o_proj, gate_up and down (each optional), added after their GEMMs
  void set_biases(int64_t i, std::optional<at::Tensor> o_bias, std::optional<at::Tensor> gate_up_bias,
                  std::optional<at::Tensor> down_bias) {
    check_layer(i);
    if (o_bias) check_vector(*o_bias, hidden, "o_proj bias [hidden]");
    if (gate_up_bias) check_vector(*gate_up_bias, 2 * intermediate, "gate_up bias [2 intermediate]");
    if (down_bias) check_vector(*down_bias, hidden, "down bias [hidden]");
    DecodeLayer& L = layers[i];
    L.o_bias = o_bias, L.gate_up_bias = gate_up_bias, L.down_bias = down_bias;
  }

  // DecodeLayer i's attention sinks, one logit per query head
  void set_sinks(int64_t i, at::Tensor sinks) {
    check_layer(i);
    check_vector(sinks, heads, "sinks [heads]");
    layers[i].sinks = sinks;
  }

  // DecodeLayer i's rotary: "none", "global" (forward's cos/sin) or "local" (forward's local_cos/local_sin)
  void set_rotary(int64_t i, const std::string& tables) {
    check_layer(i);
    TORCH_CHECK(tables == "none" || tables == "global" || tables == "local", "DecodeStack: rotary none, global or local");
    layers[i].rotary = tables == "none" ? Rotary::kNone : tables == "local" ? Rotary::kLocal : Rotary::kGlobal;
  }

  // the MLPs' activation ("silu" or "gelu_tanh") and the residual scale, for every layer
  void set_model_options(const std::string& act, double scale) {
    TORCH_CHECK(act == "silu" || act == "gelu_tanh", "DecodeStack: activation silu or gelu_tanh");
    activation = act == "silu" ? Activation::kSilu : Activation::kGeluTanh;
    residual_scale = scale;
  }

  // whether steps attend batch-invariantly (a bf16 cache's decodes as multi-token rows are): the runner's choice
  void set_invariant(bool on) { invariant = on; }

  // DecodeLayer i's attention options: a sliding window (> 0) and a soft cap on its scores (> 0), as the
  // paged kernel takes them (default none)
  void set_attention(int64_t i, int64_t window, double softcap) {
    check_layer(i);
    TORCH_CHECK(softcap >= 0, "DecodeStack: a soft cap must not be negative");
    layers[i].window = std::max<int64_t>(window, 0), layers[i].softcap = softcap;
  }

  // DecodeLayer i's weights in bf16, prepacked for oneDNN: steps given amx_rows take them (forward)
  void add_amx_weights(int64_t i, at::Tensor qkv, at::Tensor o, std::optional<at::Tensor> gate_up,
                       std::optional<at::Tensor> down) {
    check_layer(i);
    DecodeLayer& L = layers[i];
    L.qkv_amx = qkv, L.o_amx = o, L.gate_up_amx = gate_up, L.down_amx = down;
  }

  // DecodeLayer i's weights packed by amx_pack: steps of up to kAmxLinearMaxRows rows take them over oneDNN's
  void add_tile_weights(int64_t i, at::Tensor qkv, at::Tensor o, std::optional<at::Tensor> gate_up,
                        std::optional<at::Tensor> down) {
    check_layer(i);
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
  // cos/sin: the rotary tables [max_pos, head_dim]; local_cos/local_sin: the "local" layers' (set_rotary).
  // k_caches/v_caches: per layer [slots, kv_heads, head_dim], float32 or 8-bit (int8, fp8) with
  // k_scales/v_scales per layer (float32 [kv_heads, head_dim]; empty lists for float32 caches);
  // slot_mapping: int64 [T], where each row's new key and value go; block_tables, seq_info: the
  // paged attention kernel's arguments.
  // amx_rows > 0 (at least T; every layer given add_amx_weights): the linears run in oneDNN's bf16
  // GEMM over that many rows (the rows past T zero), each between two OpenMP regions of the rest.
  void forward(at::Tensor h, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
               const std::optional<at::Tensor>& local_cos, const std::optional<at::Tensor>& local_sin,
               std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, std::vector<at::Tensor> k_scales,
               std::vector<at::Tensor> v_scales, const at::Tensor& slot_mapping,
               const at::Tensor& block_tables, const at::Tensor& seq_info, int64_t block_size, double scale,
               int64_t amx_rows);

 private:
  struct Step;  // one forward call (decode_step.cpp)

  void check_layer(int64_t i) const { TORCH_CHECK(i >= 0 && i < num_layers(), "DecodeStack: no layer ", i); }
  static void check_vector(const at::Tensor& w, int64_t n, const char* what) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == n, "DecodeStack: float32 ", what);
  }

  void check_step(const at::Tensor& h, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                  const std::optional<at::Tensor>& local_cos, const std::optional<at::Tensor>& local_sin,
                  const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                  const std::vector<at::Tensor>& k_scales, const std::vector<at::Tensor>& v_scales,
                  const at::Tensor& slot_mapping, int64_t amx_rows) const;

  // the quantized inputs of the linears, by input width; kept across steps (never shrink)
  QuantizedRows qa_hidden, qa_attn, qa_inter;
};

}  // namespace kvserve
