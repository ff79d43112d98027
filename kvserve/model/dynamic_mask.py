"""Doge's dynamic mask attention: every key carries a bias of its own per K/V head, exp(A x softplus(dt_proj(v))) from
its token's values, added to each query's score for it. The cache carries the bias as one more key dim (the bias over
the softmax scale) against a query dim of 1, and the values one zero dim, so every backend attends it unchanged at
the unpadded heads' scale; the output's extra dim is cut. Torch only."""

from __future__ import annotations

import torch
from torch import nn


class DynamicMask(nn.Module):
    """A layer's key bias: ``dt_proj`` over the token's values (all K/V heads), ``A`` one factor a K/V head."""

    def __init__(self, kv_heads: int, head_dim: int, bias: bool, scale: float):
        super().__init__()
        self.head_dim, self.inv_scale = head_dim, 1.0 / scale
        self.dt_proj = nn.Linear(kv_heads * head_dim, kv_heads, bias=bias)
        self.A = nn.Parameter(torch.zeros(kv_heads))

    def widen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [t, H, d], k and v [t, KV, d] -> each one dim wider: q's 1, k's the key's bias / scale, v's 0."""
        t = v.shape[0]
        dt = self.dt_proj(v.reshape(t, -1).contiguous())
        bias = torch.exp(self.A * nn.functional.softplus(dt)) * self.inv_scale
        pad = nn.functional.pad
        return pad(q, (0, 1), value=1.0), torch.cat([k, bias[..., None].to(k.dtype)], dim=-1), pad(v, (0, 1))

    def narrow(self, o: torch.Tensor, heads: int) -> torch.Tensor:
        """Attention's output [rows, H x (d + 1)] without the values' extra dim: [rows, H x d]."""
        return o.reshape(o.shape[0], heads, self.head_dim + 1)[..., : self.head_dim].reshape(o.shape[0], -1)
