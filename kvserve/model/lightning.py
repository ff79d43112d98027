"""MiniMax's lightning attention as a token mixer: linear attention with a fixed decay per head. q, k and v from one
projection (each head's q, k, v side by side) through SiLU, no convolution; per head a state S [head_dim, head_dim]:

    S = exp(-slope) S + k v^T;  o = S^T q,

with each head's slope fixed by its index and the layer's depth (``slopes``). Then an RMSNorm over all heads' o (eps
``delta_norm_eps``), times sigmoid(output_gate(x)); out_proj. A prompt chunk runs ``BLOCK`` tokens at a time (within a
block, (q k^T masked by the decays) v; across blocks, the state); decode rows take the step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.model.config import ModelConfig
from kvserve.model.layers import RMSNorm
from kvserve.model.recurrent import RecurrentMixer
from kvserve.model.rotary import RotaryStep

BLOCK = 64  # tokens of a prompt chunk taken at once: [BLOCK, BLOCK] per head of decayed scores


def slopes(heads: int, layer: int, layers: int) -> list[float]:
    """Each head's decay rate: 2^(-8 (h + 1) / heads), scaled down linearly with depth (to ~1e-5 at the last layer)."""
    depth = 1 - layer / (layers - 1 + 1e-5) + 1e-5
    return [(2 ** (-8 / heads)) ** (h + 1) * depth for h in range(heads)]


class LightningAttention(RecurrentMixer):
    def __init__(self, cfg: ModelConfig, layer: int):
        self.heads, self.dim = cfg.num_attention_heads, int(cfg.head_dim or 0)
        self.width = self.heads * self.dim
        super().__init__(3 * self.width, 1, (self.heads, self.dim, self.dim), conv_bias=False)
        del self.kernel  # (no convolution: ``convolve`` is the activation alone)
        self.in_proj = nn.Linear(cfg.hidden_size, 4 * self.width, bias=False)  # q/k/v head by head, then the gate
        self.norm = RMSNorm(self.width, 1e-6 if cfg.delta_norm_eps is None else cfg.delta_norm_eps)
        self.out_proj = nn.Linear(self.width, cfg.hidden_size, bias=False)
        self.slopes = slopes(self.heads, layer, cfg.num_hidden_layers)

    def forward(self, x, rope: RotaryStep | None, attn: AttentionBackend, meta: AttentionMetadata,
                kv_cache: list, bf16: bool = False, rows: torch.Tensor | None = None, tokens: int | None = None):
        """As ``Attention.forward`` (``rope`` and ``kv_cache`` unused): every row's state advances, the output is
        ``rows``' only."""
        t = x.shape[0] if tokens is None else tokens
        qkv, gate = self.in_proj(x)[:t].split([3 * self.width, self.width], -1)
        o = self.norm(self.run_sequences(meta, qkv, [], self.width))
        o = torch.sigmoid(gate) * o
        return self.out_proj(o if rows is None else o[rows])

    def convolve(self, u: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.silu(u), prev

    def _inputs(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [S, heads, L, dim] in float32 and the slopes [heads]."""
        s, length = u.shape[:2]
        q, k, v = u.float().view(s, length, self.heads, 3 * self.dim).transpose(1, 2).split(self.dim, -1)
        return q, k, v, torch.tensor(self.slopes, device=u.device)

    def step(self, u: torch.Tensor, *, states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        q, k, v, rate = self._inputs(u)
        q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]  # [S, heads, dim]
        state = states[slots].masked_fill(fresh[:, None, None, None], 0) * (-rate).exp()[:, None, None]
        state = state + k[..., None] * v[..., None, :]
        states[slots] = state
        return torch.einsum("shkv,shk->shv", state, q).flatten(1)[:, None]

    def recurrence(self, u: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rule over u [S, L, 3 width] (q, k, v after SiLU) from ``state`` [S, heads, dim, dim], in float32: o [S,
        L, width] and the state after. Within a block of L tokens, o_t = e^(-r (t + 1)) S0^T q_t + sum over j <= t of
        e^(-r (t - j)) (q_t . k_j) v_j, and the state after is e^(-r L) S0 + sum over j of e^(-r (L - 1 - j)) k_j v_j^T."""
        q, k, v, rate = self._inputs(u)
        rate = rate[:, None]  # [heads, 1]
        out = []
        for start in range(0, u.shape[1], BLOCK):
            end = min(start + BLOCK, u.shape[1])
            qb, kb, vb = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
            n = end - start
            pos = torch.arange(n, device=u.device, dtype=torch.float32)
            gaps = pos[:, None] - pos[None, :]  # t - j
            decayed = (-rate[..., None] * gaps).masked_fill(gaps < 0, float("-inf")).exp()  # [heads, L, L]
            o = ((qb @ kb.transpose(-1, -2)) * decayed) @ vb + ((-rate * (pos + 1)).exp()[..., None] * qb) @ state
            state = (-rate * n).exp()[..., None] * state + \
                (kb * (-rate * (n - 1 - pos)).exp()[..., None]).transpose(-1, -2) @ vb
            out.append(o)
        return torch.cat(out, dim=2).transpose(1, 2).flatten(2), state
