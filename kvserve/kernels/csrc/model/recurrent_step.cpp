// kvserve::delta_rule_step_ and ssd_step_: one decode step of a recurrent layer (kvserve/model/gated_delta.py,
// kvserve/model/mamba.py) for a batch of sequences, each state updated in place in its slot. The state is the step's
// whole memory traffic (a gated delta net's [heads, key_dim, value_dim] floats, a Mamba-2 layer's [heads, head_dim,
// state]): read once and written once here, where torch's gather, decay, products and scatter passed over it ~9 times.
#include "common/common.h"
#include "common/rows.h"

#include <cmath>
#include <vector>

namespace kvserve {
namespace {

void check_slots(const at::Tensor& states, const at::Tensor& slots, const at::Tensor& fresh, int64_t n, const char* op) {
  TORCH_CHECK(states.scalar_type() == at::kFloat && states.is_contiguous() && states.dim() == 4,
              op, ": states float32 [slots, heads, a, b] contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() && slots.size(0) == n,
              op, ": slots int64 [S]");
  TORCH_CHECK(fresh.scalar_type() == at::kBool && fresh.dim() == 1 && fresh.is_contiguous() && fresh.size(0) == n,
              op, ": fresh bool [S]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t s = 0; s < n; ++s) TORCH_CHECK(sp[s] >= 0 && sp[s] < states.size(0), op, ": slot out of range");
}

void check_rows(const at::Tensor& x, int64_t n, int64_t heads, int64_t width, const char* op, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.numel() == n * heads * width,
              op, ": ", name, " float32 contiguous, ", n, " x ", heads, " x ", width);
}

}  // namespace

// Per sequence s and value head h, with S = states[slots[s], h] [dk, dv] (zeros where fresh[s]): S' = decay S,
// recalled = S'^T k, delta = beta (v - recalled), S = S' + k delta^T, o = S^T q = S'^T q + (k . q) delta. q and k
// [S, H, dk] (normed, scaled, one per value head), v [S, H, dv], beta and decay [S, H]. Returns o [S, H, dv].
at::Tensor delta_rule_step_(at::Tensor& states, const at::Tensor& slots, const at::Tensor& fresh, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta, const at::Tensor& decay) {
  const int64_t n = slots.size(0), heads = states.size(1), dk = states.size(2), dv = states.size(3);
  check_slots(states, slots, fresh, n, "delta_rule_step_");
  check_rows(q, n, heads, dk, "delta_rule_step_", "q");
  check_rows(k, n, heads, dk, "delta_rule_step_", "k");
  check_rows(v, n, heads, dv, "delta_rule_step_", "v");
  check_rows(beta, n, heads, 1, "delta_rule_step_", "beta");
  check_rows(decay, n, heads, 1, "delta_rule_step_", "decay");
  at::Tensor out = at::empty({n, heads, dv}, q.options());
  const int64_t* sp = slots.data_ptr<int64_t>();
  const bool* fp = fresh.data_ptr<bool>();
  float* st = states.data_ptr<float>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *bp = beta.data_ptr<float>(), *gp = decay.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n * heads, rowops::grain_rows(dk * dv), [&](int64_t i0, int64_t i1) {
    std::vector<float> rk(dv), rq(dv), delta(dv);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i / heads, h = i % heads;
      float* S = st + (sp[s] * heads + h) * dk * dv;
      const float *qi = qp + i * dk, *ki = kp + i * dk, *vi = vp + i * dv;
      const float g = gp[i], b = bp[i];
      if (fp[s]) std::fill(S, S + dk * dv, 0.f);
      std::fill(rk.begin(), rk.end(), 0.f);
      std::fill(rq.begin(), rq.end(), 0.f);
      float kq = 0.f;
      for (int64_t a = 0; a < dk; ++a) {  // one read of S for both products
        const float* row = S + a * dv;
        const float ka = ki[a], qa = qi[a];
        kq += ka * qa;
        for (int64_t j = 0; j < dv; ++j) {
          rk[j] += row[j] * ka;
          rq[j] += row[j] * qa;
        }
      }
      float* oi = op + i * dv;
      for (int64_t j = 0; j < dv; ++j) {
        delta[j] = b * (vi[j] - g * rk[j]);
        oi[j] = g * rq[j] + kq * delta[j];
      }
      for (int64_t a = 0; a < dk; ++a) {  // and one write
        float* row = S + a * dv;
        const float ka = ki[a];
        for (int64_t j = 0; j < dv; ++j) row[j] = g * row[j] + ka * delta[j];
      }
    }
  });
  return out;
}

// Per sequence s and head h, with H = states[slots[s], h] [P, N] (zeros where fresh[s]): H = exp(dt A) H + dt x B^T,
// y = H C + D x, B and C those of the head's group. x [S, heads, P], dt [S, heads] (after softplus and its limits),
// A and D [heads], B and C [S, groups, N]. Returns y [S, heads, P].
at::Tensor ssd_step_(at::Tensor& states, const at::Tensor& slots, const at::Tensor& fresh, const at::Tensor& x,
                     const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
                     const at::Tensor& D) {
  const int64_t n = slots.size(0), heads = states.size(1), p = states.size(2), ns = states.size(3);
  check_slots(states, slots, fresh, n, "ssd_step_");
  TORCH_CHECK(B.dim() == 3 && B.size(0) == n && B.size(2) == ns && heads % B.size(1) == 0,
              "ssd_step_: B [S, groups, state] with groups dividing the heads");
  const int64_t groups = B.size(1);
  check_rows(x, n, heads, p, "ssd_step_", "x");
  check_rows(dt, n, heads, 1, "ssd_step_", "dt");
  check_rows(A, 1, heads, 1, "ssd_step_", "A");
  check_rows(D, 1, heads, 1, "ssd_step_", "D");
  check_rows(B, n, groups, ns, "ssd_step_", "B");
  check_rows(C, n, groups, ns, "ssd_step_", "C");
  at::Tensor out = at::empty({n, heads, p}, x.options());
  const int64_t* sp = slots.data_ptr<int64_t>();
  const bool* fp = fresh.data_ptr<bool>();
  float* st = states.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *ap = A.data_ptr<float>();
  const float *bp = B.data_ptr<float>(), *cp = C.data_ptr<float>(), *dp = D.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const int64_t per_group = heads / groups;
  at::parallel_for(0, n * heads, rowops::grain_rows(p * ns), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i / heads, h = i % heads, g = h / per_group;
      float* Hs = st + (sp[s] * heads + h) * p * ns;
      const float step = dtp[i], decay = std::exp(step * ap[h]);
      const float *xi = xp + i * p, *bi = bp + (s * groups + g) * ns, *ci = cp + (s * groups + g) * ns;
      if (fp[s]) std::fill(Hs, Hs + p * ns, 0.f);
      float* yi = yp + i * p;
      for (int64_t a = 0; a < p; ++a) {
        float* row = Hs + a * ns;
        const float w = step * xi[a];
        float acc = 0.f;
        for (int64_t j = 0; j < ns; ++j) {
          row[j] = decay * row[j] + w * bi[j];
          acc += row[j] * ci[j];
        }
        yi[a] = acc + dp[h] * xi[a];
      }
    }
  });
  return out;
}

}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("delta_rule_step_(Tensor(a!) states, Tensor slots, Tensor fresh, Tensor q, Tensor k, Tensor v, Tensor beta, "
        "Tensor decay) -> Tensor", &kvserve::delta_rule_step_);
  m.def("ssd_step_(Tensor(a!) states, Tensor slots, Tensor fresh, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, "
        "Tensor D) -> Tensor", &kvserve::ssd_step_);
}
