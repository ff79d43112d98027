"""Differential attention (DiffLlama): each head's output is the difference of two softmaxes' outputs,
(softmax(q1 k1) - lambda softmax(q2 k2)) v, for heads paired as transformers pairs them. The two softmaxes share q and
k and differ in their values: a query head reads its K/V head's keys with the first half of the value heads, and again
with the second half. The cache holds that as one attention over heads twice as wide: keys (and queries) zero-padded
to 2 x head_dim (each rotary half followed by its zeros, so that a wide head's halves still pair rotated dims: what
the 8-bit cache's calibration measures), each K/V head's values the pair [v_a | v_b] it reads (j mod KV/2 and the same
in the second half), so any backend attends it with the scale of the unpadded heads. Heads h and h + H/2 then combine: their difference
(lambda a learned scalar a layer), RMS-normed without a weight and scaled by 1 - lambda_init. Torch only."""

from __future__ import annotations

import math

import torch
from torch import nn


def lambda_init(layer: int) -> float:
    """The layer's fixed part of lambda (the paper's schedule by depth)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer)


class DiffAttention(nn.Module):
    """A layer's differential parts: its lambda vectors (q1, k1, q2, k2 of head_dim each, stacked) and the padding
    and combining around the backend's attention."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, layer: int, eps: float):
        super().__init__()
        if heads % 2 or kv_heads % 2 or head_dim % 2:
            raise ValueError("differential attention pairs heads: num_attention_heads, num_key_value_heads and head_dim "
                             "even")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.lambda_init, self.eps = lambda_init(layer), eps
        self.lambdas = nn.Parameter(torch.zeros(4 * head_dim))

    def widen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [t, H, d], k and v [t, KV, d] -> q and k zero-padded to 2d (each half then zeros); K/V head j's values
        [v_a | v_b] (a = j mod KV/2, b = a + KV/2)."""
        half, h = self.kv_heads // 2, self.head_dim // 2
        pairs = torch.cat([v[:, :half], v[:, half:]], dim=-1).repeat(1, 2, 1)

        def wide(x: torch.Tensor) -> torch.Tensor:
            zeros = x.new_zeros(*x.shape[:-1], h)
            return torch.cat([x[..., :h], zeros, x[..., h:], zeros], dim=-1)

        return wide(q), wide(k), pairs.contiguous()

    def combine(self, o: torch.Tensor) -> torch.Tensor:
        """The wide heads' output [rows, H x 2d] -> [rows, H x d]: heads h and h + H/2 differenced, normed, scaled."""
        o = o.reshape(o.shape[0], self.heads, 2 * self.head_dim)
        q1, k1, q2, k2 = self.lambdas.float().view(4, -1)
        lam = (torch.exp((q1 * k1).sum()) - torch.exp((q2 * k2).sum())).to(o.dtype) + self.lambda_init
        first, second = o[:, : self.heads // 2], o[:, self.heads // 2:]
        diff = (first - lam * second).float()
        out = (diff * torch.rsqrt(diff.pow(2).mean(-1, keepdim=True) + self.eps)).to(o.dtype) * (1 - self.lambda_init)
        return out.reshape(o.shape[0], -1)
