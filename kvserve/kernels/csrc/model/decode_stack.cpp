// kvserve.DecodeStack: every decoder layer of a Llama-family model for one step of rows that all
// read the paged KV cache (decodes, short chunks continuing a context), in one call from Python.
//
// A layer is ~12 small ops. From Python each costs a few microseconds of interpreter and dispatch
// on top of its work, which at decode sizes is most of the step; and each op that splits across
// threads opens an OpenMP region, whose sleeping threads (OMP_WAIT_POLICY=PASSIVE, see
// kvserve/engine/worker.py) take tens of microseconds to wake: together ~8 ms of a ~13 ms
// single-stream token of the embedded model. Here the whole step is one region: its threads run
// the same kernels (common/ops.h) on their share of each op's rows or output columns, and meet at a
// spinning barrier between ops (a few hundred per step). The maths is the Python layer's
// (kvserve/model/decoder.py), op for op, with each layer's options (its spec: decode_stack.h); tests
// check the two agree bit for bit. An 8-bit KV cache
// (int8, fp8) is written as its pool quantizes (kvserve/attention/quantized_pool.py) and read by
// the paged kernel with its scales.
//
// This file checks a step's arguments and registers the class; decode_step.cpp runs the step.
#include "model/decode_stack.h"

namespace kvserve {

void DecodeStack::check_step(const at::Tensor& h, const at::Tensor& positions, const at::Tensor& cos,
                             const at::Tensor& sin, const std::optional<at::Tensor>& local_cos,
                             const std::optional<at::Tensor>& local_sin, const std::vector<at::Tensor>& k_caches,
                             const std::vector<at::Tensor>& v_caches, const std::vector<at::Tensor>& k_scales,
                             const std::vector<at::Tensor>& v_scales, const at::Tensor& slot_mapping,
                             int64_t amx_rows) const {
  const int64_t T = h.size(0);
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == at::kFloat && h.size(1) == hidden,
              "DecodeStack: h float32 [T, hidden]");
  TORCH_CHECK(k_caches.size() == layers.size() && v_caches.size() == layers.size(), "DecodeStack: one K and V cache per layer");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == T,
              "DecodeStack: slot_mapping int64 [T]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == T,
              "DecodeStack: positions int64 [T]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(1) == head_dim, "DecodeStack: cos/sin float32 [max_pos, d]");
  const bool local = std::any_of(layers.begin(), layers.end(), [](const DecodeLayer& L) { return L.rotary == Rotary::kLocal; });
  TORCH_CHECK(!local || (local_cos && local_sin && local_cos->sizes() == cos.sizes() && local_sin->sizes() == cos.sizes() &&
                         local_cos->scalar_type() == at::kFloat && local_sin->scalar_type() == at::kFloat &&
                         local_cos->is_contiguous() && local_sin->is_contiguous()),
              "DecodeStack: layers with local rotary need local_cos/local_sin float32 of cos's shape");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const bool quantized = !k_scales.empty();
  TORCH_CHECK(!quantized || (k_scales.size() == layers.size() && v_scales.size() == layers.size()),
              "DecodeStack: one K and V scale per layer, or none");
  for (size_t i = 0; i < layers.size(); ++i) {
    const at::Tensor &kc = k_caches[i], &vc = v_caches[i];
    TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.dim() == 3 && kc.size(1) == kv_heads &&
                    kc.size(2) == head_dim && vc.sizes() == kc.sizes() && vc.scalar_type() == kc.scalar_type() &&
                    kc.scalar_type() == k_caches[0].scalar_type() &&
                    (quantized || kc.scalar_type() == at::kFloat || kc.scalar_type() == at::kBFloat16),
                "DecodeStack: caches [slots, kv_heads, d] of one dtype, float32, bfloat16 or 8-bit with scales");
    if (quantized) check_kv_scales(kc, k_scales[i], v_scales[i]);
  }
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < k_caches[0].size(0), "DecodeStack: slot ", slots[t], " out of range");
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "DecodeStack: position ", pos[t], " beyond the rotary tables");
  }
  TORCH_CHECK(complete(), "DecodeStack: a layer without its MLP (an MoE layer needs set_moe)");
  TORCH_CHECK(amx_rows == 0 || (amx_rows >= T && has_amx_weights()),
              "DecodeStack: amx_rows needs bf16 weights for every layer and at least T rows");
}

}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.class_<kvserve::DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, double>())
      .def("add_layer", &kvserve::DecodeStack::add_layer)
      .def("set_qk_norm", &kvserve::DecodeStack::set_qk_norm)
      .def("set_attention", &kvserve::DecodeStack::set_attention)
      .def("set_out_norms", &kvserve::DecodeStack::set_out_norms)
      .def("set_biases", &kvserve::DecodeStack::set_biases)
      .def("set_sinks", &kvserve::DecodeStack::set_sinks)
      .def("set_rotary", &kvserve::DecodeStack::set_rotary)
      .def("set_moe", &kvserve::DecodeStack::set_moe)
      .def("set_model_options", &kvserve::DecodeStack::set_model_options)
      .def("set_invariant", &kvserve::DecodeStack::set_invariant)
      .def("add_amx_weights", &kvserve::DecodeStack::add_amx_weights)
      .def("has_amx_weights", &kvserve::DecodeStack::has_amx_weights)
      .def("add_tile_weights", &kvserve::DecodeStack::add_tile_weights)
      .def("has_tile_weights", &kvserve::DecodeStack::has_tile_weights)
      .def("num_layers", &kvserve::DecodeStack::num_layers)
      .def("forward", &kvserve::DecodeStack::forward);
}
