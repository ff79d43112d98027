// One step of kvserve.DecodeStack (decode_stack.h): every layer over the step's rows in one OpenMP
// region whose threads meet at a spinning barrier between ops (team.h), the linears on the packed
// quantized weights; or, given amx_rows, the linears in bf16 GEMMs (AMX tiles or oneDNN) between
// regions of the rest. The maths is the Python layer's (kvserve/model/decoder.py), op for op; a
// layer's options (decode_stack.h) are read once per layer, so Llama's layers run the loops they
// ran before the options existed.
#include "model/decode_stack.h"
#include "model/row_convert.h"
#include "model/team.h"
#include "common/prefetch.h"

#include <omp.h>

#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace kvserve {
namespace {

using convert::rows_from_bf16;
using convert::rows_to_bf16;
using team::share;

// y = x @ w^T through oneDNN's bf16 GEMM (torch.ops.mkldnn._linear_pointwise): x bf16 [R, K], w as
// mkldnn._reorder_linear_weight packed it; y bf16 [R, N]. Called outside any OpenMP region of ours:
// oneDNN splits the work over torch's threads itself.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack st;
  st.emplace_back(x);
  st.emplace_back(w);
  st.emplace_back(c10::IValue());
  st.emplace_back(std::string("none"));
  st.emplace_back(c10::List<std::optional<at::Scalar>>());
  st.emplace_back(c10::IValue());
  op.callBoxed(&st);
  return st[0].toTensor();
}

// y[r0, r1) += b, rows of n (a linear's bias, added after its GEMM as QuantLinear adds it)
void add_bias_rows(float* y, const float* b, int64_t n, int64_t r0, int64_t r1) {
  for (int64_t t = r0; t < r1; ++t)
    for (int64_t j = 0; j < n; ++j) y[t * n + j] += b[j];
}

// the same on a bf16 GEMM's output, each sum rounded to bf16 (torch's in-place add on a bf16 tensor)
void add_bias_rows(c10::BFloat16* y, const float* b, int64_t n, int64_t r0, int64_t r1) {
  for (int64_t t = r0; t < r1; ++t)
    for (int64_t j = 0; j < n; ++j) y[t * n + j] = c10::BFloat16(static_cast<float>(y[t * n + j]) + b[j]);
}

}  // namespace

// One forward call: its arguments, the intermediates every layer reuses (one buffer each), and one
// attention plan per distinct (window, soft cap) among the layers.
struct DecodeStack::Step {
  DecodeStack& stack;
  const int64_t T, q_size, kv_size, W;  // W: a row of qkv
  std::vector<at::Tensor> k_caches, v_caches, k_scales, v_scales;
  const int64_t* slots;
  const int64_t* pos;
  const bool quantized;
  std::vector<float> inv_scales;  // per layer, 1 / scale of K then V (the quantizer multiplies, as the pool does)
  convert::QuantizeRows quantize = nullptr;
  at::Tensor x, qkv, attn, delta, gu, act, q_view;
  float *hp, *xp, *qkvp, *attnp, *dp, *gup, *actp;
  const float feps;
  const float *cp, *sp;     // the rotary tables
  const float *lcp, *lsp;   // the local layers' rotary tables (null: none)
  const float rscale;       // the residual scale
  const int threads;
  std::vector<PagedAttentionPlan> plans;
  std::vector<size_t> plan_of;
  team::SpinBarrier barrier;
  team::Claims claims;  // the linears' output tiles

  Step(DecodeStack& stack, const at::Tensor& h, const at::Tensor& positions, const at::Tensor& cos,
       const at::Tensor& sin, const std::optional<at::Tensor>& local_cos, const std::optional<at::Tensor>& local_sin,
       std::vector<at::Tensor> k_caches_, std::vector<at::Tensor> v_caches_, std::vector<at::Tensor> k_scales_,
       std::vector<at::Tensor> v_scales_, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
       const at::Tensor& seq_info, int64_t block_size, double scale)
      : stack(stack), T(h.size(0)), q_size(stack.heads * stack.head_dim), kv_size(stack.kv_heads * stack.head_dim),
        W(q_size + 2 * kv_size), k_caches(std::move(k_caches_)), v_caches(std::move(v_caches_)),
        k_scales(std::move(k_scales_)), v_scales(std::move(v_scales_)), slots(slot_mapping.data_ptr<int64_t>()),
        pos(positions.data_ptr<int64_t>()), quantized(!k_scales.empty()), feps(static_cast<float>(stack.eps)),
        cp(cos.data_ptr<float>()), sp(sin.data_ptr<float>()),
        lcp(local_cos ? local_cos->data_ptr<float>() : nullptr), lsp(local_sin ? local_sin->data_ptr<float>() : nullptr),
        rscale(static_cast<float>(stack.residual_scale)), threads(at::get_num_threads()) {
    const int64_t kvd = stack.kv_heads * stack.head_dim;
    inv_scales.resize(quantized ? stack.layers.size() * 2 * kvd : 0);
    for (size_t i = 0; quantized && i < stack.layers.size(); ++i)
      for (int j = 0; j < 2; ++j) {
        const float* s = (j ? v_scales[i] : k_scales[i]).data_ptr<float>();
        float* inv = inv_scales.data() + (2 * i + j) * kvd;
        for (int64_t e = 0; e < kvd; ++e) inv[e] = 1.f / s[e];
      }
    if (quantized) quantize = convert::quantizer_for(k_caches[0].scalar_type());
    allocate(h);
    make_plans(block_tables, seq_info, block_size, scale);
  }

  void allocate(const at::Tensor& h) {
    const int64_t heads = stack.heads, head_dim = stack.head_dim, hidden = stack.hidden;
    const int64_t intermediate = stack.intermediate;
    const auto f32 = h.options();
    x = at::empty({T, hidden}, f32), qkv = at::empty({T, W}, f32), attn = at::empty({T, heads, head_dim}, f32);
    delta = at::empty({T, hidden}, f32), gu = at::empty({T, 2 * intermediate}, f32);
    act = at::empty({T, intermediate}, f32);
    q_view = qkv.narrow(1, 0, q_size).view({T, heads, head_dim});
    hp = h.data_ptr<float>(), xp = x.data_ptr<float>(), qkvp = qkv.data_ptr<float>();
    attnp = attn.data_ptr<float>(), dp = delta.data_ptr<float>(), gup = gu.data_ptr<float>();
    actp = act.data_ptr<float>();
    stack.qa_hidden.reserve(T, hidden);
    stack.qa_attn.reserve(T, q_size);
    stack.qa_inter.reserve(T, intermediate);
    for (DecodeLayer& L : stack.layers)
      if (L.moe) L.moe->reserve(T);
  }

  // one plan per distinct (window, soft cap) among the layers: a window changes the work items
  void make_plans(const at::Tensor& block_tables, const at::Tensor& seq_info, int64_t block_size, double scale) {
    const std::vector<DecodeLayer>& layers = stack.layers;
    plan_of.resize(layers.size());
    for (size_t i = 0; i < layers.size(); ++i) {
      size_t j = 0;
      while (j < i && (layers[j].window != layers[i].window || layers[j].softcap != layers[i].softcap)) ++j;
      if (j < i) {
        plan_of[i] = plan_of[j];
        continue;
      }
      plan_of[i] = plans.size();
      plans.emplace_back(attn, q_view, k_caches[0], v_caches[0], block_tables, seq_info, block_size, scale, threads,
                         layers[i].window, layers[i].softcap, stack.invariant);
    }
  }

  // the new K/V of rows [r0, r1) into layer i's cache
  void write_kv(size_t i, const float* inv, int64_t r0, int64_t r1) {
    if (quantized) {
      quantize(qkvp + q_size, W, k_caches[i].data_ptr(), slots, inv, kv_size, r0, r1);
      quantize(qkvp + q_size + kv_size, W, v_caches[i].data_ptr(), slots, inv + kv_size, kv_size, r0, r1);
      return;
    }
    if (k_caches[i].scalar_type() == at::kBFloat16) {  // rounded as the pool's store rounds (torch's .to)
      auto *kcp = k_caches[i].data_ptr<c10::BFloat16>(), *vcp = v_caches[i].data_ptr<c10::BFloat16>();
      for (int64_t t = r0; t < r1; ++t) {
        rows_to_bf16(qkvp + t * W + q_size, kcp + slots[t] * kv_size, kv_size, 0, 1);
        rows_to_bf16(qkvp + t * W + q_size + kv_size, vcp + slots[t] * kv_size, kv_size, 0, 1);
      }
      return;
    }
    float *kcp = k_caches[i].data_ptr<float>(), *vcp = v_caches[i].data_ptr<float>();
    for (int64_t t = r0; t < r1; ++t) {
      std::memcpy(kcp + slots[t] * kv_size, qkvp + t * W + q_size, kv_size * sizeof(float));
      std::memcpy(vcp + slots[t] * kv_size, qkvp + t * W + q_size + kv_size, kv_size * sizeof(float));
    }
  }

  // q/k/v of rows [r0, r1) as attention takes them: bias, q/k norms, rotary (each where the layer has it)
  void prepare_qkv(const DecodeLayer& L, int64_t r0, int64_t r1) {
    const int64_t heads = stack.heads, kv_heads = stack.kv_heads, head_dim = stack.head_dim;
    if (L.qkv_bias) add_bias_rows(qkvp, L.qkv_bias->data_ptr<float>(), W, r0, r1);
    if (L.q_norm) {  // per head (a row's heads are consecutive rows of head_dim) or a row's whole q and k
      const float *qn = L.q_norm->data_ptr<float>(), *kn = L.k_norm->data_ptr<float>();
      const int64_t qw = L.q_norm->numel(), kw = L.k_norm->numel();
      for (int64_t t = r0; t < r1; ++t) {
        float* row = qkvp + t * W;
        rows::rms_norm(row, qn, row, qw, feps, 0, q_size / qw);
        rows::rms_norm(row + q_size, kn, row + q_size, kw, feps, 0, kv_size / kw);
      }
    }
    if (L.rotary == Rotary::kNone) return;
    const bool local = L.rotary == Rotary::kLocal;
    const float *c = local ? lcp : cp, *s = local ? lsp : sp;
    rows::rotary(qkvp, heads, head_dim, W, pos, c, s, r0, r1);
    rows::rotary(qkvp + q_size, kv_heads, head_dim, W, pos, c, s, r0, r1);
  }

  // layer i's attention once q/k/v are in qkvp: prepare_qkv and the new K/V of this thread's rows
  // [r0, r1), then its share of the step's paged attention into attn (every thread meets at the end)
  void attend(size_t i, const DecodeLayer& L, int tid, int nt, int64_t r0, int64_t r1) {
    prepare_qkv(L, r0, r1);
    write_kv(i, quantized ? inv_scales.data() + 2 * i * kv_size : nullptr, r0, r1);
    barrier.wait();
    const float *ks = quantized ? k_scales[i].data_ptr<float>() : nullptr;
    const float *vs = quantized ? v_scales[i].data_ptr<float>() : nullptr;
    const PagedAttentionPlan& plan = plans[plan_of[i]];
    const float* sinks = L.sinks ? L.sinks->data_ptr<float>() : nullptr;
    for (int64_t c = tid; c < plan.num_chunks(); c += nt) plan.run_chunk(attn, q_view, k_caches[i], v_caches[i], c, ks, vs, sinks);
    if (plan.num_merges() > 0) {  // split decodes: combine their parts
      barrier.wait();
      const auto [m0, m1] = share(plan.num_merges(), tid, nt);
      plan.run_merges(attn, m0, m1, vs, sinks);
    }
    barrier.wait();
  }

  // h[r0, r1) += delta, the residual add after o_proj and after the MLP
  void add_delta(int64_t r0, int64_t r1) {
    const int64_t hidden = stack.hidden;
    for (int64_t t = r0; t < r1; ++t)
      for (int64_t j = 0; j < hidden; ++j) hp[t * hidden + j] += dp[t * hidden + j];
  }

  // A sublayer's input rows [r0, r1): the residual stream normed into x, or without a norm (OLMo 2's
  // layout) the stream itself
  const float* sublayer_input(const std::optional<at::Tensor>& norm, int64_t r0, int64_t r1) {
    if (!norm) return hp;
    rows::rms_norm(hp, norm->data_ptr<float>(), xp, stack.hidden, feps, r0, r1);
    return xp;
  }

  // A sublayer's output in delta, rows [r0, r1), into the residual stream: its linear's bias, its out
  // norm (Gemma's sandwich, OLMo 2), the residual scale (Granite), each where the model has it; a
  // separate pass each, rounded as the Python layer's separate ops round
  void add_sublayer_output(const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& norm,
                           int64_t r0, int64_t r1) {
    const int64_t hidden = stack.hidden;
    if (bias) add_bias_rows(dp, bias->data_ptr<float>(), hidden, r0, r1);
    if (norm) rows::rms_norm(dp, norm->data_ptr<float>(), dp, hidden, feps, r0, r1);
    if (rscale != 1.f)
      for (int64_t e = r0 * hidden; e < r1 * hidden; ++e) dp[e] *= rscale;
    add_delta(r0, r1);
  }

  // An MoE layer's MLP, this thread's part: the block's phases in this team (its rows [r0, r1) in and
  // out, as every op here), into the residual stream
  void moe_sublayer(const DecodeLayer& L, int tid, int nt, int64_t r0, int64_t r1) {
    L.moe->run(sublayer_input(L.post_norm, r0, r1), dp, T, tid, nt, barrier, true, true);
    add_sublayer_output(std::nullopt, L.mlp_out_norm, r0, r1);
  }

  // the MLP's activation of gate/up rows [r0, r1), float32 or bf16
  template <typename T>
  void activate(const T* gu, T* out, int64_t r0, int64_t r1) {
    const int64_t inter = stack.intermediate;
    const bool gelu = stack.activation == Activation::kGeluTanh;
    if constexpr (std::is_same_v<T, float>) {
      if (gelu) rows::gelu_tanh_mul(gu, out, inter, r0, r1);
      else rows::silu_mul(gu, out, inter, r0, r1);
    } else {  // bf16 through, as the Python MLP does on AMX
      if (gelu) rows::gelu_tanh_mul_bf16(gu, out, inter, r0, r1);
      else rows::silu_mul_bf16(gu, out, inter, r0, r1);
    }
  }

  // The layers with their linears in bf16 GEMMs over amx_rows rows (the rows past T zero): on AMX
  // tiles (amx_linear) for up to kAmxLinearMaxRows rows where every layer has tile weights, else in
  // oneDNN; the rest in OpenMP regions between them.
  void run_bf16_linears(int64_t amx_rows) {
    const int64_t hidden = stack.hidden, intermediate = stack.intermediate;
    const auto bf16 = attn.options().dtype(at::kBFloat16);
    at::Tensor xb = at::zeros({amx_rows, hidden}, bf16), ab = at::zeros({amx_rows, q_size}, bf16);
    at::Tensor actb = at::zeros({amx_rows, intermediate}, bf16);
    auto *xbp = xb.data_ptr<c10::BFloat16>(), *abp = ab.data_ptr<c10::BFloat16>(), *actbp = actb.data_ptr<c10::BFloat16>();
    at::Tensor y;  // the last linear's output, bf16 [amx_rows or T, n]
    auto yp = [&] { return y.data_ptr<c10::BFloat16>(); };
    const bool tiles = T <= kAmxLinearMaxRows && stack.has_tile_weights();
    auto linear = [&](const at::Tensor& xin, const std::optional<at::Tensor>& tiled, const std::optional<at::Tensor>& onednn,
                      int64_t n) { return tiles ? amx_linear(xin.narrow(0, 0, T), *tiled, n, std::nullopt) : onednn_linear(xin, *onednn); };
    // rows [r0, r1) of the last linear's output (hidden wide) into the residual stream
    auto add_linear_output = [&](const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& norm,
                                 int64_t r0, int64_t r1) {
      rows_from_bf16(yp(), dp, hidden, r0, r1);
      add_sublayer_output(bias, norm, r0, r1);
    };
    // rows [r0, r1) of a sublayer's input as its bf16 GEMM reads them
    auto input_bf16 = [&](const std::optional<at::Tensor>& norm, int64_t r0, int64_t r1) {
      rows_to_bf16(sublayer_input(norm, r0, r1), xbp, hidden, r0, r1);
    };
    for (size_t i = 0; i < stack.layers.size(); ++i) {
      const DecodeLayer& L = stack.layers[i];
      team::in_team(threads, barrier, [&](int tid, int nt) {
        const auto [r0, r1] = share(T, tid, nt);
        const DecodeLayer* prev = i > 0 ? &stack.layers[i - 1] : nullptr;  // an MoE layer added its output itself
        if (prev && !prev->moe) add_linear_output(prev->down_bias, prev->mlp_out_norm, r0, r1);
        input_bf16(L.input_norm, r0, r1);
      });
      y = linear(xb, L.qkv_tiles, L.qkv_amx, W);
      team::in_team(threads, barrier, [&](int tid, int nt) {
        const auto [r0, r1] = share(T, tid, nt);
        rows_from_bf16(yp(), qkvp, W, r0, r1);
        attend(i, L, tid, nt, r0, r1);
        rows_to_bf16(attnp, abp, q_size, r0, r1);
      });
      y = linear(ab, L.o_tiles, L.o_amx, hidden);
      team::in_team(threads, barrier, [&](int tid, int nt) {
        const auto [r0, r1] = share(T, tid, nt);
        add_linear_output(L.o_bias, L.attn_out_norm, r0, r1);
        if (L.moe) moe_sublayer(L, tid, nt, r0, r1);  // the experts on the integer kernels, as MoE.forward runs them
        else input_bf16(L.post_norm, r0, r1);
      });
      if (L.moe) continue;
      y = linear(xb, L.gate_up_tiles, L.gate_up_amx, 2 * intermediate);
      team::in_team(threads, barrier, [&](int tid, int nt) {
        const auto [r0, r1] = share(T, tid, nt);
        if (L.gate_up_bias) add_bias_rows(yp(), L.gate_up_bias->data_ptr<float>(), 2 * intermediate, r0, r1);
        activate(yp(), actbp, r0, r1);
      });
      y = linear(actb, L.down_tiles, L.down_amx, hidden);
    }
    if (stack.layers.back().moe) return;
    team::in_team(threads, barrier, [&](int tid, int nt) {
      const auto [r0, r1] = share(T, tid, nt);
      add_linear_output(stack.layers.back().down_bias, stack.layers.back().mlp_out_norm, r0, r1);
    });
  }

  // Every layer on the packed quantized weights, in one OpenMP region: each thread norms, quantizes
  // and adds its rows, and computes its tiles of each linear's output columns.
  void run_quantized() {
    const int64_t intermediate = stack.intermediate;
    claims.reset(4 * stack.layers.size(), threads);
#pragma omp parallel num_threads(threads)
    {
      const int tid = omp_get_thread_num();
#pragma omp single
      barrier.set_threads(omp_get_num_threads());  // (an implicit barrier ends the single)
      const int nt = omp_get_num_threads();
      const auto [r0, r1] = share(T, tid, nt);  // this thread's rows of row-wise ops
      // y = a @ w^T, a already quantized: chunks of ~128 KB of tiles, this thread's share first
      size_t phase = 0;
      auto linear = [&](const PackedWeight& w, const QuantizedRows& a, float* y) {
        StreamPrefetch own_stream;
        claims.run(phase++, num_tiles(w.n), std::max<int64_t>(1, (int64_t{1} << 17) / tile_bytes(w)), tid,
                   [&](int64_t t0, int64_t t1, bool own) { linear_tiles_range(w, a, T, y, t0, t1, 0, own ? &own_stream : nullptr); });
        barrier.wait();
      };
      for (size_t i = 0; i < stack.layers.size(); ++i) {
        const DecodeLayer& L = stack.layers[i];
        // attention: norm, q/k/v, rotary, the new K/V into the cache, paged attention, o_proj
        quantize_rows_range(sublayer_input(L.input_norm, r0, r1), stack.qa_hidden, r0, r1);
        barrier.wait();
        linear(L.qkv_w, stack.qa_hidden, qkvp);
        attend(i, L, tid, nt, r0, r1);
        quantize_rows_range(attnp, stack.qa_attn, r0, r1);
        barrier.wait();
        linear(L.o_w, stack.qa_attn, dp);
        // MLP: residual add and norm, gate/up, act(gate) * up, down, residual add (or the experts')
        add_sublayer_output(L.o_bias, L.attn_out_norm, r0, r1);
        if (L.moe) {
          moe_sublayer(L, tid, nt, r0, r1);
          continue;
        }
        quantize_rows_range(sublayer_input(L.post_norm, r0, r1), stack.qa_hidden, r0, r1);
        barrier.wait();
        linear(L.gate_up_w, stack.qa_hidden, gup);
        if (L.gate_up_bias) add_bias_rows(gup, L.gate_up_bias->data_ptr<float>(), 2 * intermediate, r0, r1);
        activate(gup, actp, r0, r1);
        quantize_rows_range(actp, stack.qa_inter, r0, r1);
        barrier.wait();
        linear(L.down_w, stack.qa_inter, dp);
        add_sublayer_output(L.down_bias, L.mlp_out_norm, r0, r1);
      }
    }
  }
};

void DecodeStack::forward(at::Tensor h, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                          const std::optional<at::Tensor>& local_cos, const std::optional<at::Tensor>& local_sin,
                          std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                          std::vector<at::Tensor> k_scales, std::vector<at::Tensor> v_scales,
                          const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_info,
                          int64_t block_size, double scale, int64_t amx_rows) {
  check_step(h, positions, cos, sin, local_cos, local_sin, k_caches, v_caches, k_scales, v_scales, slot_mapping, amx_rows);
  if (h.size(0) == 0) return;
  Step step(*this, h, positions, cos, sin, local_cos, local_sin, std::move(k_caches), std::move(v_caches), std::move(k_scales),
            std::move(v_scales), slot_mapping, block_tables, seq_info, block_size, scale);
  if (amx_rows > 0) step.run_bf16_linears(amx_rows);
  else step.run_quantized();
}

}  // namespace kvserve
