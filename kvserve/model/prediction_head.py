"""ModernBERT's prediction head as part of the final norm: the final LayerNorm, then a dense layer, its activation and
another LayerNorm, before the LM head. Being the final norm (its weights where the final norm's are, ``add_forward``
as every norm's), every path to the logits, and the LM head's own draw, reads the transformed rows. Torch only."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.model.layers import LayerNorm
from kvserve.model.mlp import activation


class NormedHead(LayerNorm):
    """The final LayerNorm, then ``head_norm(act(dense(x)))``."""

    def __init__(self, dim: int, eps: float, bias: bool, act: str, dense_bias: bool):
        super().__init__(dim, eps, bias)
        self.dense = nn.Linear(dim, dim, bias=dense_bias)
        self.act = activation(act)
        self.head_norm = LayerNorm(dim, eps, bias)

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        return self.head_norm(self.act(self.dense(super().normed(x))))
