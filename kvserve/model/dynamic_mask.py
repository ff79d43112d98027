"""Doge's dynamic mask attention: every key carries a bias of its own per K/V head, exp(A x softplus(dt_proj(v))) from
its token's values, added to each query's score for it. The cache carries the bias as two more key dims (half the
bias over the softmax scale, after each rotary half, so that the wide head's halves still pair rotated dims: what the
8-bit cache's calibration measures) against query dims of 1, and the values two zero dims, so every backend attends it
unchanged at the unpadded heads' scale; the output's extra dims are cut. Torch only."""

from __future__ import annotations

import torch
from torch import nn


class DynamicMask(nn.Module):
    """A layer's key bias: ``dt_proj`` over the token's values (all K/V heads), ``A`` one factor a K/V head."""

    def __init__(self, kv_heads: int, head_dim: int, bias: bool, scale: float):
        super().__init__()
        if head_dim % 2:
            raise ValueError("a key bias goes after each rotary half of a head: head_dim even")
        self.head_dim, self.inv_scale = head_dim, 1.0 / scale
        self.dt_proj = nn.Linear(kv_heads * head_dim, kv_heads, bias=bias)
        self.A = nn.Parameter(torch.zeros(kv_heads))

    def widen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [t, H, d], k and v [t, KV, d] -> each two dims wider: q's 1 after each half, k's half the key's bias /
        scale after each half, v's zeros at the end."""
        t, h = v.shape[0], self.head_dim // 2
        dt = self.dt_proj(v.reshape(t, -1).contiguous())
        bias = (torch.exp(self.A * nn.functional.softplus(dt)) * (self.inv_scale / 2))[..., None].to(k.dtype)
        ones = q.new_ones(*q.shape[:-1], 1)
        q = torch.cat([q[..., :h], ones, q[..., h:], ones], dim=-1)
        k = torch.cat([k[..., :h], bias, k[..., h:], bias], dim=-1)
        return q, k, nn.functional.pad(v, (0, 2))

    def narrow(self, o: torch.Tensor, heads: int) -> torch.Tensor:
        """Attention's output [rows, H x (d + 2)] without the values' extra dims: [rows, H x d]."""
        return o.reshape(o.shape[0], heads, self.head_dim + 2)[..., : self.head_dim].reshape(o.shape[0], -1)
