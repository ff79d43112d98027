"""Linear attention with the gated delta rule as a token mixer (Qwen3-Next, Qwen3.5): in_proj to q, k, v, the output
gate z and per value head b and a; a depthwise causal convolution over (q, k, v) with SiLU; q and k L2-normed per head
(each key head serves value_heads / key_heads value heads), q scaled by 1/sqrt(key_dim); then per value head a state S
[key_dim, value_dim]:

    S = exp(g) S;  S = S + k (beta (v - S^T k))^T;  o = S^T q,

with the decay g = -exp(A_log) softplus(a + dt_bias) and the write strength beta = sigmoid(b) (times 2 where the model allows negative eigenvalues); an RMSNorm per head of
o, times silu(z); out_proj. The states per sequence (the convolution's last inputs, S) are
``kvserve.model.recurrent``'s. A prompt chunk runs block by block (``delta_block``: the tokens' writes from one
triangular solve, the state carried across blocks); decode rows run the rule's step, every sequence's at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.kernels import ops
from kvserve.model.config import ModelConfig
from kvserve.model.recurrent import RecurrentMixer
from kvserve.model.rotary import RotaryStep

BLOCK = 64  # tokens a prompt chunk's rule solves at once: [BLOCK, BLOCK] per head of intermediate values


class GatedDeltaNet(RecurrentMixer):
    def __init__(self, cfg: ModelConfig, layer: int):  # (``layer``: the mixers' one signature)
        self.key_heads, self.value_heads = cfg.delta_key_heads, cfg.delta_value_heads
        self.key_dim, self.value_dim = cfg.delta_key_dim, cfg.delta_value_dim
        if self.value_heads % self.key_heads:
            raise ValueError(f"{self.value_heads} value heads do not share {self.key_heads} key heads evenly")
        self.keys, self.values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        super().__init__(2 * self.keys + self.values, cfg.delta_conv_kernel,
                         (self.value_heads, self.key_dim, self.value_dim), conv_bias=False)
        self.in_proj = nn.Linear(cfg.hidden_size, 2 * self.keys + 2 * self.values + 2 * self.value_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.norm_weight = nn.Parameter(torch.ones(self.value_dim))
        self.eps = cfg.rms_norm_eps if cfg.delta_norm_eps is None else cfg.delta_norm_eps
        self.beta_scale = cfg.delta_beta_scale
        self.out_proj = nn.Linear(self.values, cfg.hidden_size, bias=False)

    def forward(self, x, rope: RotaryStep | None, attn: AttentionBackend, meta: AttentionMetadata,
                kv_cache: list, bf16: bool = False, rows: torch.Tensor | None = None, tokens: int | None = None):
        """As ``Attention.forward`` (``rope`` and ``kv_cache`` unused): every row's state advances, the output is
        ``rows``' only."""
        t = x.shape[0] if tokens is None else tokens
        qkv, z, b, a = self.in_proj(x)[:t].split([self.channels, self.values, self.value_heads, self.value_heads], -1)
        o = self.run_sequences(meta, qkv, [b, a], self.values)
        o = self._gated_norm(o, z)
        return self.out_proj(o if rows is None else o[rows])

    def _inputs(self, u: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k [S, L, value heads, key_dim] (L2-normed, each key head's repeated for its value heads, q scaled), v [S,
        L, value heads, value_dim], beta and the log of the decay [S, L, value heads]; float32."""
        s, length = u.shape[:2]
        q, k, v = u.float().split([self.keys, self.keys, self.values], dim=-1)
        share = self.value_heads // self.key_heads
        q = l2norm(q.view(s, length, self.key_heads, self.key_dim)).repeat_interleave(share, dim=2)
        k = l2norm(k.view(s, length, self.key_heads, self.key_dim)).repeat_interleave(share, dim=2)
        log_decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return (q * self.key_dim ** -0.5, k, v.view(s, length, self.value_heads, self.value_dim),
                torch.sigmoid(b.float()) * self.beta_scale, log_decay)

    def step(self, u: torch.Tensor, b: torch.Tensor, a: torch.Tensor, *, states: torch.Tensor, slots: torch.Tensor,
             fresh: torch.Tensor) -> torch.Tensor:
        q, k, v, beta, log_decay = self._inputs(u, b, a)
        o = ops.delta_rule_step_(states, slots, fresh, q[:, 0], k[:, 0], v[:, 0], beta[:, 0], log_decay[:, 0].exp(),
                                 native=self.native)
        return o.flatten(1)[:, None]

    def recurrence(self, u: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated delta rule over u [S, L, channels] (q, k, v after the convolution) and b, a [S, L, value heads]
        from ``state`` [S, value heads, key_dim, value_dim], in float32: o [S, L, values] and the state after."""
        q, k, v, beta, log_decay = self._inputs(u, b, a)
        # heads before positions for the block products: [S, heads, L, dim]
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        beta, log_decay = beta.transpose(1, 2), log_decay.transpose(1, 2)
        out = []
        for start in range(0, u.shape[1], BLOCK):
            end = min(start + BLOCK, u.shape[1])
            o, state = delta_block(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end],
                                   beta[:, :, start:end], log_decay[:, :, start:end], state)
            out.append(o)
        return torch.cat(out, dim=2).transpose(1, 2).flatten(2), state

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """An RMSNorm over each value head of o, times the weight, then times silu(z) (in float32; o's dtype after the
        norm, as transformers rounds)."""
        heads = o.float().view(o.shape[0], self.value_heads, self.value_dim)
        normed = (heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + self.eps)).to(o.dtype)
        gated = (self.norm_weight * normed).float() * F.silu(z.float().view_as(heads))
        return gated.view(o.shape[0], self.values).to(o.dtype)


def delta_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, log_decay: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over one block of L tokens at once: q, k [S, H, L, key_dim], v [S, H, L, value_dim], beta and log_decay
    [S, H, L], state [S, H, key_dim, value_dim] before the block. With G the decay's running sum, what token j writes is
    w_j = beta_j (v_j - e^G_j S0^T k_j - sum over i < j of e^(G_j - G_i) (k_j . k_i) w_i): a unit lower-triangular system
    in the block's w. Then o_t = e^G_t S0^T q_t + sum over j <= t of e^(G_t - G_j) (q_t . k_j) w_j, and the state after
    is e^G_L S0 + sum over j of e^(G_L - G_j) k_j w_j^T."""
    length = q.shape[2]
    g = log_decay.cumsum(-1)  # [S, H, L]
    gaps = (g[..., :, None] - g[..., None, :])  # [S, H, L (t), L (j)]: G_t - G_j
    below = torch.ones(length, length, dtype=torch.bool, device=q.device).tril(-1)
    decayed = gaps.masked_fill(~below, float("-inf")).exp()  # e^(G_t - G_j) for j < t, else 0
    coupling = beta[..., None] * decayed * (k @ k.transpose(-1, -2))
    eye = torch.eye(length, dtype=q.dtype, device=q.device)
    rhs = beta[..., None] * (v - g.exp()[..., None] * (k @ state))
    w = torch.linalg.solve_triangular(eye + coupling, rhs, upper=False, unitriangular=True)
    within = gaps.masked_fill(~(below | eye.bool()), float("-inf")).exp() * (q @ k.transpose(-1, -2))
    o = g.exp()[..., None] * (q @ state) + within @ w
    state = g[..., -1:, None].exp() * state + k.transpose(-1, -2) @ ((g[..., -1:] - g).exp()[..., None] * w)
    return o, state


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x over its last dim's L2 norm (eps inside the root, as the fla library's kernels)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
