"""Linear attention with the gated delta rule as a token mixer (Qwen3-Next, Qwen3.5): in_proj to q, k, v, the output
gate z and per value head b and a; a depthwise causal convolution over (q, k, v) with SiLU; q and k L2-normed per head
(each key head serves value_heads / key_heads value heads), q scaled by 1/sqrt(key_dim); then per value head a state S
[key_dim, value_dim]:

    S = exp(g) S;  S = S + k (beta (v - S^T k))^T;  o = S^T q,

with the decay g = -exp(A_log) softplus(a + dt_bias) and the write strength beta = sigmoid(b); an RMSNorm per head of
o, times silu(z); out_proj. The states per sequence (the convolution's last inputs, S) are
``kvserve.model.recurrent``'s. The rule runs token by token, every sequence of a group at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.model.config import ModelConfig
from kvserve.model.recurrent import RecurrentMixer
from kvserve.model.rotary import RotaryStep


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
        self.eps = cfg.rms_norm_eps
        self.out_proj = nn.Linear(self.values, cfg.hidden_size, bias=False)

    def forward(self, x, rope: RotaryStep | None, attn: AttentionBackend, meta: AttentionMetadata,
                kv_cache: list, bf16: bool = False, rows: torch.Tensor | None = None, tokens: int | None = None):
        """As ``Attention.forward`` (``rope`` and ``kv_cache`` unused): every row's state advances, the output is
        ``rows``' only."""
        t = x.shape[0] if tokens is None else tokens
        qkv, z, b, a = self.in_proj(x)[:t].split([self.channels, self.values, self.value_heads, self.value_heads], -1)
        o = self.run_sequences(meta, qkv, [b, a], self.values, self._rule)
        o = self._gated_norm(o, z)
        return self.out_proj(o if rows is None else o[rows])

    def _rule(self, u: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated delta rule over u [S, L, channels] (q, k, v after the convolution) and b, a [S, L, value heads]
        from ``state`` [S, value heads, key_dim, value_dim], in float32: o [S, L, values] and the state after."""
        s, length = u.shape[:2]
        q, k, v = u.float().split([self.keys, self.keys, self.values], dim=-1)
        share = self.value_heads // self.key_heads
        q = l2norm(q.view(s, length, self.key_heads, self.key_dim)).repeat_interleave(share, dim=2)
        k = l2norm(k.view(s, length, self.key_heads, self.key_dim)).repeat_interleave(share, dim=2)
        q = q * self.key_dim ** -0.5
        v = v.view(s, length, self.value_heads, self.value_dim)
        beta = torch.sigmoid(b.float())
        decay = (-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())).exp()
        out = []
        for i in range(length):
            state = state * decay[:, i, :, None, None]
            recalled = torch.einsum("shkv,shk->shv", state, k[:, i])
            state = state + k[:, i, :, :, None] * ((v[:, i] - recalled) * beta[:, i, :, None])[:, :, None, :]
            out.append(torch.einsum("shkv,shk->shv", state, q[:, i]))
        return torch.stack(out, dim=1).flatten(2), state

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """An RMSNorm over each value head of o, times the weight, then times silu(z) (in float32; o's dtype after the
        norm, as transformers rounds)."""
        heads = o.float().view(o.shape[0], self.value_heads, self.value_dim)
        normed = (heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + self.eps)).to(o.dtype)
        gated = (self.norm_weight * normed).float() * F.silu(z.float().view_as(heads))
        return gated.view(o.shape[0], self.values).to(o.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x over its last dim's L2 norm (eps inside the root, as the fla library's kernels)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
