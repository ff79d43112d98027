// MoEBlock's phases (moe_block.h): a row's routing (router GEMV, softmax or sigmoids, top-k), the step's slots grouped
// by expert, the grouped GEMMs over (expert, column tile) ranges, and each row's weighted sum of its
// experts' outputs in ascending expert id. Every per-row result is computed in the same order whatever
// the step's other rows are; the products and sums of the combine are separate passes, rounded as the
// Python loop's separate ops round (kvserve/model/mlp.py).
#include "gemm/quant_format.h"
#include "model/moe_block.h"

#include <algorithm>
#include <cstring>

namespace kvserve {
namespace {

float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// gpt-oss's SwiGLU: g = min(gate, limit), (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g)
void clamped_swiglu(const float* gu, float* out, int64_t inter, float alpha, float limit) {
  for (int64_t j = 0; j < inter; ++j) {
    const float g = std::min(gu[j], limit), u = std::clamp(gu[inter + j], -limit, limit);
    out[j] = (u + 1.f) * g * (1.f / (1.f + std::exp(-alpha * g)));
  }
}

// marks `taken` every expert outside the best `used` of `groups` equal groups (each ranked by its best score, or
// its best two's sum), so that the top-k picks among the rest; a tie goes to the lower group id
void outside_best_groups(const float* score, int64_t E, int64_t groups, int64_t used, bool top2, float* rank,
                         char* kept, char* taken) {
  const int64_t per = E / groups;
  for (int64_t g = 0; g < groups; ++g) {
    float first = -std::numeric_limits<float>::infinity(), second = first;
    for (int64_t e = g * per; e < (g + 1) * per; ++e) {
      if (score[e] > first) second = first, first = score[e];
      else if (score[e] > second) second = score[e];
    }
    rank[g] = top2 ? first + second : first, kept[g] = 0;
  }
  for (int64_t j = 0; j < used; ++j) {
    int64_t best = -1;
    for (int64_t g = 0; g < groups; ++g)
      if (!kept[g] && (best < 0 || rank[g] > rank[best])) best = g;
    kept[best] = 1;
  }
  for (int64_t e = 0; e < E; ++e) taken[e] = !kept[e / per];
}

}  // namespace

void MoEBlock::route_rows(const float* x, int64_t r0, int64_t r1) {
  const int64_t E = num_experts();
  const float* w = router.data_ptr<float>();
  const float* b = router_bias ? router_bias->data_ptr<float>() : nullptr;
  const float* sb = selection_bias ? selection_bias->data_ptr<float>() : nullptr;
  std::vector<float> p(E), score(E);
  std::vector<char> taken(E), kept(groups);
  std::vector<float> rank(groups);
  const bool grouped = groups_used < groups;
  for (int64_t t = r0; t < r1; ++t) {
    const float* xr = x + t * hidden;
    float mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
    for (int64_t e = 0; e < E; ++e) {
      p[e] = dot(xr, w + e * hidden, hidden) + (b ? b[e] : 0.f);
      mx = std::max(mx, p[e]);
    }
    if (sigmoid) {
      for (int64_t e = 0; e < E; ++e) p[e] = 1.f / (1.f + std::exp(-p[e]));
    } else {
      for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(p[e] - mx));
      for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    }
    for (int64_t e = 0; e < E; ++e) score[e] = sb ? p[e] + sb[e] : p[e];
    if (grouped)
      outside_best_groups(score.data(), E, groups, groups_used, group_top2, rank.data(), kept.data(), taken.data());
    else
      std::fill(taken.begin(), taken.end(), 0);
    float picked = 0.f;
    for (int64_t j = 0; j < top_k; ++j) {  // the largest score first; a tie goes to the lower expert id
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || score[e] > score[best])) best = e;
      taken[best] = 1;
      ws_->ids[t * top_k + j] = best, ws_->weights[t * top_k + j] = p[best];
      picked += p[best];
    }
    if (norm_topk)
      for (int64_t j = 0; j < top_k; ++j) ws_->weights[t * top_k + j] /= picked;
    if (routed_scale != 1.f)
      for (int64_t j = 0; j < top_k; ++j) ws_->weights[t * top_k + j] *= routed_scale;
    if (shared)
      ws_->gate[t] = shared_gate ? 1.f / (1.f + std::exp(-dot(xr, shared_gate->data_ptr<float>(), hidden))) : 1.f;
  }
}

void MoEBlock::group(int64_t T, bool with_shared) {
  const int64_t E = num_experts(), picks = T * top_k;
  std::vector<int64_t> start(E, 0);
  for (int64_t i = 0; i < picks; ++i) ++start[ws_->ids[i]];
  groups_.clear();
  int64_t slot = 0, gu_tiles = 0, dn_tiles = 0;
  auto add = [&](int64_t expert, int64_t rows) {
    const Expert& x = expert < 0 ? *shared : experts[expert];
    groups_.push_back({expert, slot, rows, gu_tiles, dn_tiles});
    for (int64_t s = slot; s < slot + rows; ++s) ws_->slot_group[s] = static_cast<int64_t>(groups_.size()) - 1;
    slot += rows, gu_tiles += num_tiles(2 * x.inter), dn_tiles += num_tiles(hidden);
  };
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = start[e];
    start[e] = slot;
    if (rows > 0) add(e, rows);
  }
  routed_slots_ = slot;
  for (int64_t i = 0; i < picks; ++i) {  // rows in ascending order within each expert's slots
    const int64_t s = start[ws_->ids[i]]++;
    ws_->slot_row[s] = i / top_k, ws_->slot_w[s] = ws_->weights[i], ws_->slot_of[i] = s;
  }
  if (with_shared) {
    for (int64_t t = 0; t < T; ++t) ws_->slot_row[slot + t] = t, ws_->slot_w[slot + t] = ws_->gate[t];
    add(-1, T);
  }
  gu_tiles_ = gu_tiles, down_tiles_ = dn_tiles;
}

void MoEBlock::gather_rows(int64_t s0, int64_t s1) {
  const int64_t nb = ws_->qx.nb;
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t t = ws_->slot_row[s];
    std::memcpy(ws_->qxs.q.data() + s * hidden, ws_->qx.q.data() + t * hidden, hidden);
    std::memcpy(ws_->qxs.d.data() + s * nb, ws_->qx.d.data() + t * nb, nb * sizeof(float));
    std::memcpy(ws_->qxs.s.data() + s * nb, ws_->qx.s.data() + t * nb, nb * sizeof(float));
    std::memcpy(ws_->qxs.qsum.data() + s * nb, ws_->qx.qsum.data() + t * nb, nb * sizeof(int32_t));
  }
}

void MoEBlock::gate_up_tiles(int64_t w0, int64_t w1) {
  for (const Group& g : groups_) {
    const Expert& e = expert_of(g);
    const int64_t n = num_tiles(2 * e.inter), lo = std::max(w0, g.gu_tile0), hi = std::min(w1, g.gu_tile0 + n);
    if (lo < hi)
      linear_tiles_range(e.gate_up_w, ws_->qxs, g.rows, ws_->gu.data() + g.slot0 * 2 * max_inter_, lo - g.gu_tile0,
                         hi - g.gu_tile0, g.slot0);
  }
}

void MoEBlock::activate_slots(int64_t s0, int64_t s1) {
  for (int64_t s = s0; s < s1; ++s) {
    const Group& g = groups_[ws_->slot_group[s]];
    const Expert& e = expert_of(g);
    const int64_t inter = e.inter, r = s - g.slot0;
    float* gu = ws_->gu.data() + g.slot0 * 2 * max_inter_ + r * 2 * inter;
    if (e.gate_up_bias) {
      const float* b = e.gate_up_bias->data_ptr<float>();
      for (int64_t j = 0; j < 2 * inter; ++j) gu[j] += b[j];
    }
    // routed slots quantized as rows of the scratch's qact, the shared expert's (row r) as rows of its qact_shared
    const bool routed = g.expert >= 0;
    std::vector<float>& buf = routed ? ws_->act : ws_->act_shared;
    const int64_t row = routed ? s : r;
    float* out = buf.data() + row * inter;
    if (act == ExpertAct::kSwiglu) clamped_swiglu(gu, out, inter, alpha, limit);
    else if (act == ExpertAct::kGeluTanh) rows::gelu_tanh_mul(gu, out, inter, 0, 1);
    else rows::silu_mul(gu, out, inter, 0, 1);
    quantize_rows_range(buf.data(), routed ? ws_->qact : ws_->qact_shared, row, row + 1);
  }
}

void MoEBlock::down_tiles(int64_t w0, int64_t w1) {
  for (const Group& g : groups_) {
    const Expert& e = expert_of(g);
    const int64_t n = num_tiles(hidden), lo = std::max(w0, g.down_tile0), hi = std::min(w1, g.down_tile0 + n);
    const bool routed = g.expert >= 0;
    if (lo < hi)
      linear_tiles_range(e.down_w, routed ? ws_->qact : ws_->qact_shared, g.rows, ws_->ys.data() + g.slot0 * hidden,
                         lo - g.down_tile0, hi - g.down_tile0, routed ? g.slot0 : 0);
  }
}

void MoEBlock::combine_rows(float* out, int64_t r0, int64_t r1, bool with_shared) {
  std::vector<int64_t> slots(top_k + 1);
  for (int64_t t = r0; t < r1; ++t) {
    // slots are laid out by ascending expert id: sorting a row's slots sorts its experts
    std::copy(ws_->slot_of.begin() + t * top_k, ws_->slot_of.begin() + (t + 1) * top_k, slots.begin());
    std::sort(slots.begin(), slots.begin() + top_k);
    int64_t n = top_k;
    if (with_shared) slots[n++] = routed_slots_ + t;
    float* o = out + t * hidden;
    std::fill(o, o + hidden, 0.f);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = slots[i];
      const Expert& e = expert_of(groups_[ws_->slot_group[s]]);
      float* y = ws_->ys.data() + s * hidden;
      const float w = ws_->slot_w[s];
      if (e.down_bias) {
        const float* b = e.down_bias->data_ptr<float>();
        for (int64_t j = 0; j < hidden; ++j) y[j] += b[j];
      }
      for (int64_t j = 0; j < hidden; ++j) y[j] *= w;
      for (int64_t j = 0; j < hidden; ++j) o[j] += y[j];
    }
  }
}

}  // namespace kvserve
