// Paged decode attention for the CPU: one query token per sequence, keys and values read in
// place from the paged cache through each sequence's slot list (no gather copy).
// Parallel over (sequence, kv head); the query heads sharing a kv head (GQA) are done together,
// so each key and value row is read once per step.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

template <typename T>
static void decode_kernel(const T* q, const T* kc, const T* vc, const int64_t* slots, const int64_t* ctx,
                          T* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t L, float scale) {
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / KVH, kh = idx % KVH, n = ctx[b];
      const int64_t* sl = slots + b * L;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(q[(b * H + kh * G) * D + i]) * scale;
      scores.assign(G * n, 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const T* kp = kc + (sl[t] * KVH + kh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * static_cast<float>(kp[d]);
          scores[g * n + t] = s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) { sg[t] = std::exp(sg[t] - mx); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const T* vp = vc + (sl[t] * KVH + kh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * n + t];
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) ag[d] += w * static_cast<float>(vp[d]);
        }
      }
      for (int64_t i = 0; i < G * D; ++i) out[(b * H + kh * G) * D + i] = static_cast<T>(acc[i]);
    }
  });
}

// q: [B, H, D]; k_cache, v_cache: [S, KVH, D]; slots: [B, L] int64; ctx_lens: [B] int64.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                           torch::Tensor ctx_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs expected");
  TORCH_CHECK(slots.is_contiguous() && ctx_lens.is_contiguous(), "contiguous slots expected");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1), L = slots.size(1);
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            slots.data_ptr<int64_t>(), ctx_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H,
                            KVH, D, L, static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode, "paged decode attention (CPU)"); }
