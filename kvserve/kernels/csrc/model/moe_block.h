// kvserve.MoEBlock (moe_block.cpp, moe_route.cpp): a mixture-of-experts MLP on the packed quantized weights.
// A step's rows are routed (router GEMM, softmax or sigmoids, top-k of the scores plus any selection bias, within
// the row's best expert groups where they restrict the choice),
// then grouped by expert: every routed expert runs
// gate_up, its activation and down once over just its rows, the threads splitting (expert, column tile)
// pairs; each row then sums its experts' weighted outputs in ascending expert id, so a row's result never
// depends on which other rows share its step. The decode stack runs the same code inside its own team.
#pragma once
#include "common/ops.h"
#include "model/team.h"

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <torch/custom_class.h>

namespace kvserve {

// an expert's activation between gate_up and down: act(gate) * up, or gpt-oss's clamped SwiGLU
enum class ExpertAct : int8_t { kSilu, kGeluTanh, kSwiglu };

struct Expert {
  at::Tensor gate_up, down;  // pack_quant'ed [2 inter, hidden], [hidden, inter]
  PackedWeight gate_up_w, down_w;
  std::optional<at::Tensor> gate_up_bias, down_bias;
  int64_t inter;
};

// A step's per-row and per-slot buffers. Every block a thread runs shares that thread's one (blocks run one
// after another), sized for the largest step so far: per block, a 2048-token prefill's would be ~400 MB
// at OLMoE's shapes, 6 GB over its 16 layers, all first touched in that step.
struct MoEScratch {
  std::vector<int64_t> ids, slot_of, slot_row, slot_group;
  std::vector<float> weights, gate, slot_w, gu, act, act_shared, ys;
  QuantizedRows qx, qxs, qact, qact_shared;
};

struct MoEBlock : torch::CustomClassHolder {
  int64_t hidden, top_k;
  bool norm_topk;
  ExpertAct act;
  float alpha, limit;             // the clamped SwiGLU's (limit inf: no clamp)
  at::Tensor router;              // float32 [experts, hidden]
  std::optional<at::Tensor> router_bias;
  // float32 [experts], added to a row's probabilities to choose its experts; their weights are the probabilities
  std::optional<at::Tensor> selection_bias;
  bool sigmoid = false;     // each expert scored by sigmoid(logit) on its own, not by the softmax over them
  float routed_scale = 1.f;  // the routed experts' weights multiplied by this, after norm_topk
  // expert groups (DeepSeek): a row's experts come from its best groups_used of `groups` equal groups, each ranked
  // by its best choosing score or (top2) the sum of its best two; groups_used >= groups: any expert
  int64_t groups = 1, groups_used = 1;
  bool group_top2 = false;
  std::vector<Expert> experts;    // the routed ones
  // a shared expert, every row's: weighted by sigmoid(shared_gate . x) (Qwen2-MoE), or by 1 without a gate
  // (Granite MoE Shared)
  std::optional<Expert> shared;
  std::optional<at::Tensor> shared_gate;  // float32 [hidden]

  MoEBlock(int64_t hidden, int64_t top_k, bool norm_topk, const std::string& act, double alpha, double limit);

  void set_router(at::Tensor weight, std::optional<at::Tensor> bias);
  void set_selection_bias(at::Tensor bias);
  void set_scoring(bool sigmoid_scores, double scale);
  void set_groups(int64_t num_groups, int64_t used, bool top2);
  void add_expert(at::Tensor gate_up, const std::string& gate_up_kind, at::Tensor down, const std::string& down_kind,
                  std::optional<at::Tensor> gate_up_bias, std::optional<at::Tensor> down_bias);
  void set_shared(at::Tensor gate_up, const std::string& gate_up_kind, at::Tensor down, const std::string& down_kind,
                  std::optional<at::Tensor> gate);
  int64_t num_experts() const { return static_cast<int64_t>(experts.size()); }

  // x float32 [T, hidden] -> the block's output [T, hidden]: routed, and with the shared expert where
  // `with_shared` (False: the caller runs it, e.g. under a LoRA adapter)
  at::Tensor forward(const at::Tensor& x, bool with_shared);
  // the grouped experts alone, for given top-k choices: ids int64 [T, k], weights float32 [T, k]
  at::Tensor run_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights);

  // For a team (the decode stack's): reserve(T) on the calling thread before the parallel region (it
  // points the block at that thread's MoEScratch, grown to fit), then every thread calls
  // run(tid, nt) over the same x and out. Thread tid reads x's and writes out's rows share(T, tid, nt)
  // only before and after the barriers inside, so it needs none around it.
  void reserve(int64_t T);
  int64_t scratch_bytes() const;  // the calling thread's MoEScratch, which every block it runs shares
  void run(const float* x, float* out, int64_t T, int tid, int nt, team::SpinBarrier& barrier, bool route,
           bool with_shared);

 private:
  // a step's grouping of its slots by expert
  struct Group {
    int64_t expert;         // index into experts, or -1: the shared expert
    int64_t slot0, rows;    // its slots [slot0, slot0 + rows)
    int64_t gu_tile0, down_tile0;  // its first tile in the step's (group, tile) lists
  };
  std::vector<Group> groups_;
  int64_t routed_slots_ = 0, gu_tiles_ = 0, down_tiles_ = 0, max_inter_ = 0;
  MoEScratch* ws_ = nullptr;  // the calling thread's (reserve)

  const Expert& expert_of(const Group& g) const { return g.expert < 0 ? *shared : experts[g.expert]; }
  void route_rows(const float* x, int64_t r0, int64_t r1);
  void group(int64_t T, bool with_shared);
  void gather_rows(int64_t s0, int64_t s1);
  void gate_up_tiles(int64_t w0, int64_t w1);
  void activate_slots(int64_t s0, int64_t s1);
  void down_tiles(int64_t w0, int64_t w1);
  void combine_rows(float* out, int64_t r0, int64_t r1, bool with_shared);
  Expert make_expert(at::Tensor gate_up, const std::string& gate_up_kind, at::Tensor down, const std::string& down_kind,
                     std::optional<at::Tensor> gate_up_bias, std::optional<at::Tensor> down_bias) const;
  void check_x(const at::Tensor& x) const;
};

}  // namespace kvserve
