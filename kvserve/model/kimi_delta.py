"""Kimi Delta Attention (Kimi Linear) as a token mixer: the gated delta rule of ``kvserve.model.gated_delta`` with a
decay per key channel instead of one per head. q, k and v come from their own projections (one GEMM here, with the
forget gate's and the output gate's low-rank inputs and b), through one depthwise causal convolution with SiLU; q and
k L2-normed per head, q scaled by 1/sqrt(head_dim); heads of q, k and v alike (head_dim each). Per head a state S
[head_dim (keys), head_dim (values)]:

    S = diag(exp(g)) S;  S = S + k (beta (v - S^T k))^T;  o = S^T q,

with g = -exp(A_log) softplus(f_b(f_a(x)) + dt_bias) per channel and beta = sigmoid(b). Then an RMSNorm per head of
o, times its weight and sigmoid(g_b(g_a(x))), all in float32; o_proj. Ling 3 (``delta_gate_rank`` 0) projects f and
the output gate at full width in one step, and bounds the decay (``delta_decay_bound``: g = bound sigmoid(exp(A_log)
(f + dt_bias)), its "safe gate"). A prompt chunk runs ``BLOCK`` tokens at a
time (the decay per channel makes each pair's coupling a sum over channels, kept [L, L, head_dim] per head); decode
rows take the rule's step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.model.config import ModelConfig
from kvserve.model.gated_delta import l2norm
from kvserve.model.recurrent import RecurrentMixer
from kvserve.model.rotary import RotaryStep

BLOCK = 32  # tokens a prompt chunk's rule solves at once: [BLOCK, BLOCK, head_dim] per head of couplings


class KimiDeltaAttention(RecurrentMixer):
    def __init__(self, cfg: ModelConfig, layer: int):  # (``layer``: the mixers' one signature)
        self.heads, self.dim = cfg.delta_value_heads, cfg.delta_value_dim
        if (cfg.delta_key_heads, cfg.delta_key_dim) != (self.heads, self.dim):
            raise ValueError("Kimi delta attention has as many key heads as value heads, of one head_dim")
        self.width = self.heads * self.dim
        self.rank = cfg.delta_gate_rank  # 0: f and the output gate projected at full width
        self.bound = cfg.delta_decay_bound
        super().__init__(3 * self.width, cfg.delta_conv_kernel, (self.heads, self.dim, self.dim), conv_bias=False)
        # q, k, v, the forget gate's and the output gate's low-rank inputs, b: one GEMM
        gates = self.rank or self.width
        self.split = [3 * self.width, gates, gates, self.heads]
        self.in_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=False)
        self.f_b = nn.Linear(self.rank, self.width, bias=False) if self.rank else None
        self.g_b = nn.Linear(self.rank, self.width, bias=False) if self.rank else None
        self.dt_bias = nn.Parameter(torch.zeros(self.width))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.norm_weight = nn.Parameter(torch.ones(self.dim))
        self.eps = cfg.rms_norm_eps if cfg.delta_norm_eps is None else cfg.delta_norm_eps
        self.out_proj = nn.Linear(self.width, cfg.hidden_size, bias=False)

    def forward(self, x, rope: RotaryStep | None, attn: AttentionBackend, meta: AttentionMetadata,
                kv_cache: list, bf16: bool = False, rows: torch.Tensor | None = None, tokens: int | None = None):
        """As ``Attention.forward`` (``rope`` and ``kv_cache`` unused): every row's state advances, the output is
        ``rows``' only."""
        t = x.shape[0] if tokens is None else tokens
        qkv, f, g, b = self.in_proj(x)[:t].split(self.split, -1)
        if self.f_b is not None and self.g_b is not None:
            f, g = self.f_b(f), self.g_b(g)
        o = self.run_sequences(meta, qkv, [b, self._log_decay(f)], self.width)
        o = self._gated_norm(o, g)
        return self.out_proj(o if rows is None else o[rows])

    def _log_decay(self, f: torch.Tensor) -> torch.Tensor:
        """The decay's log per channel [T, width] (float32): -exp(A_log) softplus(f + dt_bias), each head's A_log (or,
        bounded, bound sigmoid(exp(A_log) (f + dt_bias)))."""
        gate = (f.float() + self.dt_bias.float()).view(-1, self.heads, self.dim)
        rate = self.A_log.float().exp()[:, None]
        g = -rate * F.softplus(gate) if self.bound is None else self.bound * torch.sigmoid(rate * gate)
        return g.reshape(-1, self.width)

    def _inputs(self, u: torch.Tensor, b: torch.Tensor, log_decay: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v, the log decay [S, L, heads, dim] (q, k L2-normed, q scaled) and beta [S, L, heads]; float32."""
        s, length = u.shape[:2]
        q, k, v = (p.reshape(s, length, self.heads, self.dim) for p in u.float().split(self.width, dim=-1))
        return (l2norm(q) * self.dim ** -0.5, l2norm(k), v, torch.sigmoid(b.float()),
                log_decay.view(s, length, self.heads, self.dim))

    def step(self, u: torch.Tensor, b: torch.Tensor, log_decay: torch.Tensor, *, states: torch.Tensor,
             slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        q, k, v, beta, g = (x[:, 0] for x in self._inputs(u, b, log_decay))  # [S, heads, ...]
        state = states[slots].masked_fill(fresh[:, None, None, None], 0) * g.exp()[..., None]
        recalled = torch.einsum("shkv,shk->shv", state, k)
        state = state + k[..., None] * (beta[..., None] * (v - recalled))[..., None, :]
        states[slots] = state
        return torch.einsum("shkv,shk->shv", state, q).flatten(1)[:, None]

    def recurrence(self, u: torch.Tensor, b: torch.Tensor, log_decay: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rule over u [S, L, channels] (q, k, v after the convolution), b [S, L, heads] and the log decay [S, L,
        width] from ``state`` [S, heads, dim, dim], in float32: o [S, L, width] and the state after."""
        q, k, v, beta, g = self._inputs(u, b, log_decay)
        q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))  # [S, heads, L, dim]
        beta = beta.transpose(1, 2)
        out = []
        for start in range(0, u.shape[1], BLOCK):
            end = min(start + BLOCK, u.shape[1])
            o, state = channel_delta_block(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end],
                                           beta[:, :, start:end], g[:, :, start:end], state)
            out.append(o)
        return torch.cat(out, dim=2).transpose(1, 2).flatten(2), state

    def _gated_norm(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """An RMSNorm over each head of o, times the weight and sigmoid(gate), in float32 (o's dtype after)."""
        heads = o.float().view(o.shape[0], self.heads, self.dim)
        normed = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight.float()
        gated = normed * torch.sigmoid(gate.float().view_as(heads))
        return gated.view(o.shape[0], self.width).to(o.dtype)


def channel_delta_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, log_decay: torch.Tensor,
                        state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gated_delta.delta_block`` with the decay per key channel: q, k, v and log_decay [S, H, L, dim], beta [S, H,
    L], state [S, H, dim, dim]. With G the decay's running sum per channel, token j writes w_j = beta_j (v_j -
    S0^T (e^G_j k_j) - sum over i < j of (k_j . e^(G_j - G_i) k_i) w_i); o_t = S0^T (e^G_t q_t) + sum over j <= t of
    (q_t . e^(G_t - G_j) k_j) w_j; the state after is e^G_L S0 + sum over j of (e^(G_L - G_j) k_j) w_j^T."""
    length = q.shape[2]
    g = log_decay.cumsum(2)  # [S, H, L, dim]
    below = torch.ones(length, length, dtype=torch.bool, device=q.device).tril(-1)
    upto = below | torch.eye(length, dtype=torch.bool, device=q.device)
    gaps = g[:, :, :, None] - g[:, :, None]  # [S, H, L (t), L (j), dim]: G_t - G_j, masked to 0 where not j <= t
    decayed = gaps.masked_fill(~upto[:, :, None], float("-inf")).exp()
    pair = decayed * k[:, :, None]  # e^(G_t - G_j) k_j
    coupling = (k[:, :, :, None] * pair).sum(-1).masked_fill(~below, 0) * beta[..., None]
    eye = torch.eye(length, dtype=q.dtype, device=q.device)
    rhs = beta[..., None] * (v - (g.exp() * k) @ state)
    w = torch.linalg.solve_triangular(eye + coupling, rhs, upper=False, unitriangular=True)
    within = (q[:, :, :, None] * pair).sum(-1)
    o = (g.exp() * q) @ state + within @ w
    last = g[:, :, -1:]
    state = last.transpose(-1, -2).exp() * state + ((last - g).exp() * k).transpose(-1, -2) @ w
    return o, state
