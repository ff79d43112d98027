// kvserve.DecodeStack: every decoder layer of a Llama-family model for one step of rows that all
// read the paged KV cache (decodes, short chunks continuing a context), in one call from Python.
//
// A layer is ~12 small ops. From Python each costs a few microseconds of interpreter and dispatch
// on top of its work, which at decode sizes is most of the step; and each op that splits across
// threads opens an OpenMP region, whose sleeping threads (OMP_WAIT_POLICY=PASSIVE, see
// kvserve/engine/worker.py) take tens of microseconds to wake: together ~8 ms of a ~13 ms
// single-stream token of the embedded model. Here the whole step is one region: its threads run
// the same kernels (ops.h) on their share of each op's rows or output columns, and meet at a
// spinning barrier between ops (a few hundred per step). The maths is the Python layer's
// (kvserve/model/llama.py), op for op; tests check the two agree bit for bit. An 8-bit KV cache
// (int8, fp8) is written as its pool quantizes (kvserve/attention/quantized_pool.py) and read by
// the paged kernel with its scales.
#include "ops.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/custom_class.h>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace {

// Threads wait for each other between ops by spinning, then yielding: a thread whose partner was
// preempted (by the server's API process on a small machine) gives its core back to the scheduler
// instead of burning its time slice.
class SpinBarrier {
 public:
  void set_threads(int n) { n_ = n; }
  void wait() {
    const int phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; phase_.load(std::memory_order_acquire) == phase; ++spins) {
      if (spins < kSpins) {
#if defined(__SSE2__)
        _mm_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  static constexpr int kSpins = 2000;  // ~10-50 us of pauses before yielding
  std::atomic<int> arrived_{0}, phase_{0};
  int n_ = 1;
};

// [begin, end) of thread `tid`'s share of n items
inline std::pair<int64_t, int64_t> share(int64_t n, int tid, int threads) {
  return {n * tid / threads, n * (tid + 1) / threads};
}

// New K or V rows into an 8-bit cache, as QuantizedKVPool.quantize does it: x * (1 / scale),
// saturated at +-qmax, rounded to nearest even (int8) or converted (fp8 rounds to nearest itself).
template <typename T>
void quantize_rows(const float* src, int64_t src_stride, T* dst, const int64_t* slots, const float* inv_scale,
                   int64_t n, int64_t r0, int64_t r1) {
  const float qmax = std::is_same_v<T, int8_t> ? 127.f : static_cast<float>(std::numeric_limits<T>::max());
  for (int64_t t = r0; t < r1; ++t) {
    const float* x = src + t * src_stride;
    T* out = dst + slots[t] * n;
    for (int64_t i = 0; i < n; ++i) {
      const float y = std::min(std::max(x[i] * inv_scale[i], -qmax), qmax);
      if constexpr (std::is_same_v<T, int8_t>) out[i] = static_cast<int8_t>(std::nearbyint(y));
      else out[i] = T(y);
    }
  }
}

using QuantizeRows = void (*)(const float*, int64_t, void*, const int64_t*, const float*, int64_t, int64_t, int64_t);

template <typename T>
void quantize_rows_erased(const float* src, int64_t src_stride, void* dst, const int64_t* slots, const float* inv_scale,
                          int64_t n, int64_t r0, int64_t r1) {
  quantize_rows<T>(src, src_stride, static_cast<T*>(dst), slots, inv_scale, n, r0, r1);
}

QuantizeRows quantizer_for(at::ScalarType s) {
  if (s == at::kChar) return &quantize_rows_erased<int8_t>;
  if (s == at::kFloat8_e4m3fn) return &quantize_rows_erased<c10::Float8_e4m3fn>;
  return &quantize_rows_erased<c10::Float8_e5m2>;
}

struct Layer {
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

// Round to nearest even, as c10::BFloat16(float) does for finite values, in integer ops the compiler
// vectorizes (activations are finite: no NaN case).
inline void rows_to_bf16(const float* x, c10::BFloat16* y, int64_t n, int64_t r0, int64_t r1) {
  const uint32_t* in = reinterpret_cast<const uint32_t*>(x);
  uint16_t* out = reinterpret_cast<uint16_t*>(y);
  for (int64_t i = r0 * n; i < r1 * n; ++i) out[i] = static_cast<uint16_t>((in[i] + 0x7fffu + ((in[i] >> 16) & 1u)) >> 16);
}

inline void rows_from_bf16(const c10::BFloat16* x, float* y, int64_t n, int64_t r0, int64_t r1) {
  const uint16_t* in = reinterpret_cast<const uint16_t*>(x);
  uint32_t* out = reinterpret_cast<uint32_t*>(y);
  for (int64_t i = r0 * n; i < r1 * n; ++i) out[i] = static_cast<uint32_t>(in[i]) << 16;
}

// f(tid, threads) on a team of `threads`, with `barrier` set up for it
template <class F>
void in_team(int threads, SpinBarrier& barrier, F&& f) {
#pragma omp parallel num_threads(threads)
  {
#pragma omp single
    barrier.set_threads(omp_get_num_threads());
    f(omp_get_thread_num(), omp_get_num_threads());
  }
}

}  // namespace

namespace kvserve {

struct DecodeStack : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim, hidden, intermediate;
  double eps;
  std::vector<Layer> layers;

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
    Layer L{input_norm, post_norm, qkv, o, gate_up, down,
            packed_weight(qkv, qkv_kind, q_size + 2 * kv_size, hidden), packed_weight(o, o_kind, hidden, q_size),
            packed_weight(gate_up, gate_up_kind, 2 * intermediate, hidden),
            packed_weight(down, down_kind, hidden, intermediate), qkv_bias};
    layers.push_back(std::move(L));
  }

  // Layer i's q and k heads normed (each head's head_dim values, the layers' eps) before rotary
  void set_qk_norm(int64_t i, at::Tensor q_norm, at::Tensor k_norm) {
    TORCH_CHECK(i >= 0 && i < num_layers(), "DecodeStack: no layer ", i);
    for (const at::Tensor* w : {&q_norm, &k_norm})
      TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->numel() == head_dim,
                  "DecodeStack: float32 q/k norm weights of head_dim");
    layers[i].q_norm = q_norm, layers[i].k_norm = k_norm;
  }

  // Layer i's attention options: a sliding window (> 0) and a soft cap on its scores (> 0), as the
  // paged kernel takes them (default none)
  void set_attention(int64_t i, int64_t window, double softcap) {
    TORCH_CHECK(i >= 0 && i < num_layers(), "DecodeStack: no layer ", i);
    TORCH_CHECK(softcap >= 0, "DecodeStack: a soft cap must not be negative");
    layers[i].window = std::max<int64_t>(window, 0), layers[i].softcap = softcap;
  }

  // Layer i's weights in bf16, prepacked for oneDNN: steps given amx_rows take them (forward)
  void add_amx_weights(int64_t i, at::Tensor qkv, at::Tensor o, at::Tensor gate_up, at::Tensor down) {
    TORCH_CHECK(i >= 0 && i < num_layers(), "DecodeStack: no layer ", i);
    Layer& L = layers[i];
    L.qkv_amx = qkv, L.o_amx = o, L.gate_up_amx = gate_up, L.down_amx = down;
  }

  // Layer i's weights packed by amx_pack: steps of up to kAmxLinearMaxRows rows take them over oneDNN's
  void add_tile_weights(int64_t i, at::Tensor qkv, at::Tensor o, at::Tensor gate_up, at::Tensor down) {
    TORCH_CHECK(i >= 0 && i < num_layers(), "DecodeStack: no layer ", i);
    Layer& L = layers[i];
    L.qkv_tiles = qkv, L.o_tiles = o, L.gate_up_tiles = gate_up, L.down_tiles = down;
  }

  bool has_tile_weights() const {
    return !layers.empty() && std::all_of(layers.begin(), layers.end(), [](const Layer& L) { return L.qkv_tiles.has_value(); });
  }

  bool has_amx_weights() const {
    return !layers.empty() && std::all_of(layers.begin(), layers.end(), [](const Layer& L) { return L.qkv_amx.has_value(); });
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
               int64_t amx_rows) {
    const int64_t T = h.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim, W = q_size + 2 * kv_size;
    TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == at::kFloat && h.size(1) == hidden,
                "DecodeStack: h float32 [T, hidden]");
    TORCH_CHECK(k_caches.size() == layers.size() && v_caches.size() == layers.size(), "DecodeStack: one K and V cache per layer");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == T,
                "DecodeStack: slot_mapping int64 [T]");
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == T,
                "DecodeStack: positions int64 [T]");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.size(1) == head_dim, "DecodeStack: cos/sin float32 [max_pos, d]");
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
    // per layer, 1 / scale of K then V (the quantizer multiplies, as the pool does)
    std::vector<float> inv_scales(quantized ? layers.size() * 2 * kv_heads * head_dim : 0);
    for (size_t i = 0; quantized && i < layers.size(); ++i)
      for (int j = 0; j < 2; ++j) {
        const float* s = (j ? v_scales[i] : k_scales[i]).data_ptr<float>();
        float* inv = inv_scales.data() + (2 * i + j) * kv_heads * head_dim;
        for (int64_t e = 0; e < kv_heads * head_dim; ++e) inv[e] = 1.f / s[e];
      }
    const QuantizeRows quantize = quantized ? quantizer_for(k_caches[0].scalar_type()) : nullptr;
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(slots[t] >= 0 && slots[t] < k_caches[0].size(0), "DecodeStack: slot ", slots[t], " out of range");
      TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "DecodeStack: position ", pos[t], " beyond the rotary tables");
    }
    TORCH_CHECK(amx_rows == 0 || (amx_rows >= T && has_amx_weights()),
                "DecodeStack: amx_rows needs bf16 weights for every layer and at least T rows");
    if (T == 0) return;

    // one buffer per intermediate, reused by every layer
    const auto f32 = h.options();
    at::Tensor x = at::empty({T, hidden}, f32), qkv = at::empty({T, W}, f32), attn = at::empty({T, heads, head_dim}, f32);
    at::Tensor delta = at::empty({T, hidden}, f32), gu = at::empty({T, 2 * intermediate}, f32);
    at::Tensor act = at::empty({T, intermediate}, f32);
    const at::Tensor q_view = qkv.narrow(1, 0, q_size).view({T, heads, head_dim});
    float *hp = h.data_ptr<float>(), *xp = x.data_ptr<float>(), *qkvp = qkv.data_ptr<float>();
    float *attnp = attn.data_ptr<float>(), *dp = delta.data_ptr<float>(), *gup = gu.data_ptr<float>();
    float* actp = act.data_ptr<float>();
    qa_hidden.reserve(T, hidden);
    qa_attn.reserve(T, q_size);
    qa_inter.reserve(T, intermediate);
    const float feps = static_cast<float>(eps);
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();

    const int threads = at::get_num_threads();
    // one plan per distinct (window, soft cap) among the layers: a window changes the work items
    std::vector<PagedAttentionPlan> plans;
    std::vector<size_t> plan_of(layers.size());
    for (size_t i = 0; i < layers.size(); ++i) {
      size_t j = 0;
      while (j < i && (layers[j].window != layers[i].window || layers[j].softcap != layers[i].softcap)) ++j;
      if (j < i) {
        plan_of[i] = plan_of[j];
        continue;
      }
      plan_of[i] = plans.size();
      plans.emplace_back(attn, q_view, k_caches[0], v_caches[0], block_tables, seq_info, block_size, scale, threads,
                         layers[i].window, layers[i].softcap);
    }
    SpinBarrier barrier;
    // the new K/V of rows [r0, r1) into layer i's cache
    auto write_kv = [&](size_t i, const float* inv, int64_t r0, int64_t r1) {
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
    };
    auto add_bias = [&](const Layer& L, int64_t r0, int64_t r1) {
      if (!L.qkv_bias) return;
      const float* b = L.qkv_bias->data_ptr<float>();
      for (int64_t t = r0; t < r1; ++t)
        for (int64_t j = 0; j < W; ++j) qkvp[t * W + j] += b[j];
    };
    // layer i's attention once q/k/v are in qkvp: bias, rotary and the new K/V of this thread's rows
    // [r0, r1), then its share of the step's paged attention into attn (every thread meets at the end)
    auto attend = [&](size_t i, const Layer& L, int tid, int nt, int64_t r0, int64_t r1) {
      add_bias(L, r0, r1);
      if (L.q_norm) {  // a row's heads are consecutive rows of head_dim: normed in place
        const float *qn = L.q_norm->data_ptr<float>(), *kn = L.k_norm->data_ptr<float>();
        for (int64_t t = r0; t < r1; ++t) {
          float* row = qkvp + t * W;
          rows::rms_norm(row, qn, row, head_dim, static_cast<float>(eps), 0, heads);
          rows::rms_norm(row + q_size, kn, row + q_size, head_dim, static_cast<float>(eps), 0, kv_heads);
        }
      }
      rows::rotary(qkvp, heads, head_dim, W, pos, cp, sp, r0, r1);
      rows::rotary(qkvp + q_size, kv_heads, head_dim, W, pos, cp, sp, r0, r1);
      write_kv(i, quantized ? inv_scales.data() + 2 * i * kv_size : nullptr, r0, r1);
      barrier.wait();
      const float *ks = quantized ? k_scales[i].data_ptr<float>() : nullptr;
      const float *vs = quantized ? v_scales[i].data_ptr<float>() : nullptr;
      const PagedAttentionPlan& plan = plans[plan_of[i]];
      for (int64_t c = tid; c < plan.num_chunks(); c += nt) plan.run_chunk(attn, q_view, k_caches[i], v_caches[i], c, ks, vs);
      if (plan.num_merges() > 0) {  // split decodes: combine their parts
        barrier.wait();
        const auto [m0, m1] = share(plan.num_merges(), tid, nt);
        plan.run_merges(attn, m0, m1, vs);
      }
      barrier.wait();
    };
    if (amx_rows > 0) {  // the same ops, the linears between regions
      const auto bf16 = h.options().dtype(at::kBFloat16);
      at::Tensor xb = at::zeros({amx_rows, hidden}, bf16), ab = at::zeros({amx_rows, q_size}, bf16);
      at::Tensor actb = at::zeros({amx_rows, intermediate}, bf16);
      auto *xbp = xb.data_ptr<c10::BFloat16>(), *abp = ab.data_ptr<c10::BFloat16>(), *actbp = actb.data_ptr<c10::BFloat16>();
      at::Tensor y;  // the last linear's output, bf16 [amx_rows or T, n]
      auto yp = [&] { return y.data_ptr<c10::BFloat16>(); };
      const bool tiles = T <= kAmxLinearMaxRows && has_tile_weights();
      auto linear = [&](const at::Tensor& xin, const std::optional<at::Tensor>& tiled, const std::optional<at::Tensor>& onednn,
                        int64_t n) { return tiles ? amx_linear(xin.narrow(0, 0, T), *tiled, n, std::nullopt) : onednn_linear(xin, *onednn); };
      // rows [r0, r1) of the last linear's output (hidden wide) added to the residual stream
      auto add_linear_output = [&](int64_t r0, int64_t r1) {
        rows_from_bf16(yp(), dp, hidden, r0, r1);
        for (int64_t t = r0; t < r1; ++t)
          for (int64_t j = 0; j < hidden; ++j) hp[t * hidden + j] += dp[t * hidden + j];
      };
      for (size_t i = 0; i < layers.size(); ++i) {
        const Layer& L = layers[i];
        in_team(threads, barrier, [&](int tid, int nt) {
          const auto [r0, r1] = share(T, tid, nt);
          if (i > 0) add_linear_output(r0, r1);  // the previous layer's down projection
          rows::rms_norm(hp, L.input_norm.data_ptr<float>(), xp, hidden, feps, r0, r1);
          rows_to_bf16(xp, xbp, hidden, r0, r1);
        });
        y = linear(xb, L.qkv_tiles, L.qkv_amx, W);
        in_team(threads, barrier, [&](int tid, int nt) {
          const auto [r0, r1] = share(T, tid, nt);
          rows_from_bf16(yp(), qkvp, W, r0, r1);
          attend(i, L, tid, nt, r0, r1);
          rows_to_bf16(attnp, abp, q_size, r0, r1);
        });
        y = linear(ab, L.o_tiles, L.o_amx, hidden);
        in_team(threads, barrier, [&](int tid, int nt) {
          const auto [r0, r1] = share(T, tid, nt);
          add_linear_output(r0, r1);
          rows::rms_norm(hp, L.post_norm.data_ptr<float>(), xp, hidden, feps, r0, r1);
          rows_to_bf16(xp, xbp, hidden, r0, r1);
        });
        y = linear(xb, L.gate_up_tiles, L.gate_up_amx, 2 * intermediate);
        in_team(threads, barrier, [&](int tid, int nt) {
          const auto [r0, r1] = share(T, tid, nt);
          rows::silu_mul_bf16(yp(), actbp, intermediate, r0, r1);  // bf16 through, as SwiGLU does on AMX
        });
        y = linear(actb, L.down_tiles, L.down_amx, hidden);
      }
      in_team(threads, barrier, [&](int tid, int nt) {
        const auto [r0, r1] = share(T, tid, nt);
        add_linear_output(r0, r1);
      });
      return;
    }
#pragma omp parallel num_threads(threads)
    {
      const int tid = omp_get_thread_num();
#pragma omp single
      barrier.set_threads(omp_get_num_threads());  // (an implicit barrier ends the single)
      const int nt = omp_get_num_threads();
      const auto [r0, r1] = share(T, tid, nt);  // this thread's rows of row-wise ops
      // y = a @ w^T, a already quantized: this thread's tiles of output columns
      auto linear = [&](const PackedWeight& w, const QuantizedRows& a, float* y) {
        const auto [t0, t1] = share(num_tiles(w.n), tid, nt);
        linear_tiles_range(w, a, T, y, t0, t1);
        barrier.wait();
      };
      for (size_t i = 0; i < layers.size(); ++i) {
        const Layer& L = layers[i];
        // attention: norm, q/k/v, rotary, the new K/V into the cache, paged attention, o_proj
        rows::rms_norm(hp, L.input_norm.data_ptr<float>(), xp, hidden, feps, r0, r1);
        quantize_rows_range(xp, qa_hidden, r0, r1);
        barrier.wait();
        linear(L.qkv_w, qa_hidden, qkvp);
        attend(i, L, tid, nt, r0, r1);
        quantize_rows_range(attnp, qa_attn, r0, r1);
        barrier.wait();
        linear(L.o_w, qa_attn, dp);
        // MLP: residual add and norm, gate/up, SiLU * up, down, residual add
        for (int64_t t = r0; t < r1; ++t)
          for (int64_t j = 0; j < hidden; ++j) hp[t * hidden + j] += dp[t * hidden + j];
        rows::rms_norm(hp, L.post_norm.data_ptr<float>(), xp, hidden, feps, r0, r1);
        quantize_rows_range(xp, qa_hidden, r0, r1);
        barrier.wait();
        linear(L.gate_up_w, qa_hidden, gup);
        rows::silu_mul(gup, actp, intermediate, r0, r1);
        quantize_rows_range(actp, qa_inter, r0, r1);
        barrier.wait();
        linear(L.down_w, qa_inter, dp);
        for (int64_t t = r0; t < r1; ++t)
          for (int64_t j = 0; j < hidden; ++j) hp[t * hidden + j] += dp[t * hidden + j];
      }
    }
  }

 private:
  // the quantized inputs of the linears, by input width; kept across steps (never shrink)
  QuantizedRows qa_hidden, qa_attn, qa_inter;
};

}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.class_<kvserve::DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, double>())
      .def("add_layer", &kvserve::DecodeStack::add_layer)
      .def("set_qk_norm", &kvserve::DecodeStack::set_qk_norm)
      .def("set_attention", &kvserve::DecodeStack::set_attention)
      .def("add_amx_weights", &kvserve::DecodeStack::add_amx_weights)
      .def("has_amx_weights", &kvserve::DecodeStack::has_amx_weights)
      .def("add_tile_weights", &kvserve::DecodeStack::add_tile_weights)
      .def("has_tile_weights", &kvserve::DecodeStack::has_tile_weights)
      .def("num_layers", &kvserve::DecodeStack::num_layers)
      .def("forward", &kvserve::DecodeStack::forward);
}
