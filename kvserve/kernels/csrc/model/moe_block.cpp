// kvserve.MoEBlock (moe_block.h): its weights, the checks on them, one call's phases in a team, and the
// class torch registers. The routing, grouping and combining of a step's rows are moe_route.cpp's.
//
// One call is one OpenMP region: each thread routes and quantizes its rows; one thread groups the step's
// (row, expert) slots by expert; then every thread takes its share of the step's slots (gathering
// their quantized inputs, activations) and of its (expert, column tile) pairs (gate_up, down), with a
// barrier between phases, so a decode step's few rows per expert still keep every core on the GEMMs.
#include "model/moe_block.h"
#include "gemm/quant_format.h"

#include <algorithm>

namespace kvserve {

using team::share;

namespace {

MoEScratch& thread_scratch() {
  static thread_local MoEScratch scratch;
  return scratch;
}

template <typename... V>
int64_t bytes_of(const V&... v) {
  return (int64_t{0} + ... + static_cast<int64_t>(v.size() * sizeof(typename V::value_type)));
}

int64_t bytes_of_rows(const QuantizedRows& r) { return bytes_of(r.q, r.d, r.s, r.qsum); }

}  // namespace

MoEBlock::MoEBlock(int64_t hidden, int64_t top_k, bool norm_topk, const std::string& act_name, double alpha,
                   double limit)
    : hidden(hidden), top_k(top_k), norm_topk(norm_topk), alpha(static_cast<float>(alpha)),
      limit(limit > 0 ? static_cast<float>(limit) : std::numeric_limits<float>::infinity()) {
  TORCH_CHECK(act_name == "silu" || act_name == "gelu_tanh" || act_name == "swiglu",
              "MoEBlock: activation silu, gelu_tanh or swiglu");
  TORCH_CHECK(top_k > 0 && hidden % 32 == 0, "MoEBlock: top_k > 0 and hidden a multiple of 32");
  act = act_name == "silu" ? ExpertAct::kSilu : act_name == "gelu_tanh" ? ExpertAct::kGeluTanh : ExpertAct::kSwiglu;
}

void MoEBlock::set_router(at::Tensor weight, std::optional<at::Tensor> bias) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.dim() == 2 &&
                  weight.size(1) == hidden && weight.size(0) >= top_k,
              "MoEBlock: router float32 [experts >= top_k, hidden]");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == weight.size(0)),
              "MoEBlock: router bias float32 [experts]");
  router = weight, router_bias = bias;
}

void MoEBlock::set_scoring(bool sigmoid_scores, double scale) {
  sigmoid = sigmoid_scores, routed_scale = static_cast<float>(scale);
}

void MoEBlock::set_groups(int64_t num_groups, int64_t used, bool top2) {
  const int64_t E = router.size(0);
  TORCH_CHECK(num_groups > 0 && E % num_groups == 0 && used > 0 && (!top2 || E / num_groups >= 2) &&
                  top_k <= std::min(used, num_groups) * (E / num_groups),
              "MoEBlock: experts in equal groups (2+ each for top2), enough in the used ones for top_k (after set_router)");
  groups = num_groups, groups_used = used, group_top2 = top2;
}

void MoEBlock::set_selection_bias(at::Tensor bias) {
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == router.size(0),
              "MoEBlock: selection bias float32 [experts] (after set_router)");
  selection_bias = bias;
}

Expert MoEBlock::make_expert(at::Tensor gate_up, const std::string& gate_up_kind, at::Tensor down,
                             const std::string& down_kind, std::optional<at::Tensor> gate_up_bias,
                             std::optional<at::Tensor> down_bias) const {
  Expert e;
  e.gate_up = gate_up, e.down = down, e.gate_up_bias = gate_up_bias, e.down_bias = down_bias;
  // down is [hidden, inter]: its tiles of hidden / 8 output columns hold inter / 32 blocks each
  e.inter = down.numel() / (num_tiles(hidden) * quant::format_of(down_kind).block_bytes) * quant::QK;
  e.gate_up_w = packed_weight(gate_up, gate_up_kind, 2 * e.inter, hidden);
  e.down_w = packed_weight(down, down_kind, hidden, e.inter);
  auto check = [](const std::optional<at::Tensor>& b, int64_t n) {
    TORCH_CHECK(!b || (b->scalar_type() == at::kFloat && b->is_contiguous() && b->numel() == n),
                "MoEBlock: expert biases float32 [2 inter] and [hidden]");
  };
  check(gate_up_bias, 2 * e.inter);
  check(down_bias, hidden);
  return e;
}

void MoEBlock::add_expert(at::Tensor gate_up, const std::string& gate_up_kind, at::Tensor down,
                          const std::string& down_kind, std::optional<at::Tensor> gate_up_bias,
                          std::optional<at::Tensor> down_bias) {
  Expert e = make_expert(gate_up, gate_up_kind, down, down_kind, gate_up_bias, down_bias);
  TORCH_CHECK(experts.empty() || e.inter == experts[0].inter, "MoEBlock: routed experts of one intermediate size");
  max_inter_ = std::max(max_inter_, e.inter);
  experts.push_back(std::move(e));
}

void MoEBlock::set_shared(at::Tensor gate_up, const std::string& gate_up_kind, at::Tensor down,
                          const std::string& down_kind, std::optional<at::Tensor> gate) {
  TORCH_CHECK(!gate || (gate->scalar_type() == at::kFloat && gate->is_contiguous() && gate->numel() == hidden),
              "MoEBlock: shared expert gate float32 [hidden]");
  shared = make_expert(gate_up, gate_up_kind, down, down_kind, std::nullopt, std::nullopt);
  shared_gate = gate;
  max_inter_ = std::max(max_inter_, shared->inter);
}

void MoEBlock::reserve(int64_t T) {
  TORCH_CHECK(router.defined() && router.size(0) == num_experts(), "MoEBlock: a router row per expert");
  MoEScratch& scratch = thread_scratch();
  ws_ = &scratch;
  const int64_t picks = T * top_k, slots = picks + (shared ? T : 0), inter = experts.empty() ? 0 : experts[0].inter;
  const auto fit = [](auto& v, int64_t n) { if (static_cast<int64_t>(v.size()) < n) v.resize(n); };
  fit(scratch.ids, picks), fit(scratch.slot_of, picks), fit(scratch.weights, picks), fit(scratch.gate, T);
  fit(scratch.slot_row, slots), fit(scratch.slot_group, slots), fit(scratch.slot_w, slots);
  fit(scratch.gu, slots * 2 * max_inter_), fit(scratch.ys, slots * hidden), fit(scratch.act, picks * inter);
  scratch.qx.reserve(T, hidden), scratch.qxs.reserve(slots, hidden), scratch.qact.reserve(picks, inter);
  if (shared) fit(scratch.act_shared, T * shared->inter), scratch.qact_shared.reserve(T, shared->inter);
}

int64_t MoEBlock::scratch_bytes() const {
  const MoEScratch& s = thread_scratch();
  const int64_t rows = bytes_of_rows(s.qx) + bytes_of_rows(s.qxs) + bytes_of_rows(s.qact) + bytes_of_rows(s.qact_shared);
  return rows + bytes_of(s.ids, s.slot_of, s.slot_row, s.slot_group, s.weights, s.gate, s.slot_w, s.gu, s.act,
                         s.act_shared, s.ys);
}

void MoEBlock::run(const float* x, float* out, int64_t T, int tid, int nt, team::SpinBarrier& barrier, bool route,
                   bool with_shared) {
  with_shared = with_shared && shared.has_value();
  const auto [r0, r1] = share(T, tid, nt);
  if (route) route_rows(x, r0, r1);
  quantize_rows_range(x, ws_->qx, r0, r1);
  barrier.wait();
  if (tid == 0) group(T, with_shared);
  barrier.wait();
  const int64_t slots = routed_slots_ + (with_shared ? T : 0);
  const auto [s0, s1] = share(slots, tid, nt);
  gather_rows(s0, s1);
  barrier.wait();
  const auto [g0, g1] = share(gu_tiles_, tid, nt);
  gate_up_tiles(g0, g1);
  barrier.wait();
  activate_slots(s0, s1);
  barrier.wait();
  const auto [d0, d1] = share(down_tiles_, tid, nt);
  down_tiles(d0, d1);
  barrier.wait();
  combine_rows(out, r0, r1, with_shared);
}

void MoEBlock::check_x(const at::Tensor& x) const {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == hidden &&
                  x.device().is_cpu(), "MoEBlock: x float32 [T, hidden], contiguous");
  TORCH_CHECK(!experts.empty(), "MoEBlock: no experts");
}

at::Tensor MoEBlock::forward(const at::Tensor& x, bool with_shared) {
  check_x(x);
  const int64_t T = x.size(0);
  at::Tensor out = at::empty({T, hidden}, x.options());
  if (T == 0) return out;
  reserve(T);
  team::SpinBarrier barrier;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  team::in_team(at::get_num_threads(), barrier,
                [&](int tid, int nt) { run(xp, op, T, tid, nt, barrier, true, with_shared); });
  return out;
}

at::Tensor MoEBlock::run_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights) {
  check_x(x);
  const int64_t T = x.size(0);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.dim() == 2 && ids.size(0) == T &&
                  ids.size(1) == top_k, "MoEBlock: ids int64 [T, top_k]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.sizes() == ids.sizes(),
              "MoEBlock: weights float32 [T, top_k]");
  at::Tensor out = at::empty({T, hidden}, x.options());
  if (T == 0) return out;
  reserve(T);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t e = ip[t * top_k + j];
      TORCH_CHECK(e >= 0 && e < num_experts(), "MoEBlock: expert ", e, " out of range");
      for (int64_t i = 0; i < j; ++i) TORCH_CHECK(ip[t * top_k + i] != e, "MoEBlock: a row picks expert ", e, " twice");
    }
  std::copy(ip, ip + T * top_k, ws_->ids.begin());
  std::copy(weights.data_ptr<float>(), weights.data_ptr<float>() + T * top_k, ws_->weights.begin());
  team::SpinBarrier barrier;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  team::in_team(at::get_num_threads(), barrier,
                [&](int tid, int nt) { run(xp, op, T, tid, nt, barrier, false, false); });
  return out;
}

}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.class_<kvserve::MoEBlock>("MoEBlock")
      .def(torch::init<int64_t, int64_t, bool, std::string, double, double>())
      .def("set_router", &kvserve::MoEBlock::set_router)
      .def("set_selection_bias", &kvserve::MoEBlock::set_selection_bias)
      .def("set_scoring", &kvserve::MoEBlock::set_scoring)
      .def("set_groups", &kvserve::MoEBlock::set_groups)
      .def("add_expert", &kvserve::MoEBlock::add_expert)
      .def("set_shared", &kvserve::MoEBlock::set_shared)
      .def("num_experts", &kvserve::MoEBlock::num_experts)
      .def("forward", &kvserve::MoEBlock::forward)
      .def("run_experts", &kvserve::MoEBlock::run_experts)
      .def("scratch_bytes", &kvserve::MoEBlock::scratch_bytes);
}
