"""Griffin's recurrent block as a token mixer (RecurrentGemma): in_proj to x and the gate branch y; a depthwise causal
convolution of ``lru_conv_kernel`` taps over x (with a bias, no activation); the real-gated linear recurrent unit
(RG-LRU) per channel, its input and recurrence gates from block-diagonal linears (``lru_blocks`` blocks of the width):

    a = exp(-8 r softplus(lambda)),  h = a h + sqrt(1 - a^2) (i x)   (the sqrt factor 1 at position 0),

then h * gelu_tanh(y) through out_proj. The state per sequence (the convolution's last inputs, h [width]) is
``kvserve.model.recurrent``'s; every row runs the recurrence in turn (a decay per channel: no block form here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.model.config import ModelConfig
from kvserve.model.mlp import activation
from kvserve.model.recurrent import RecurrentMixer
from kvserve.model.rotary import RotaryStep


class RGLRU(RecurrentMixer):
    conv_silu = False  # Griffin's convolution feeds the recurrence as it is

    def __init__(self, cfg: ModelConfig, layer: int):  # (``layer``: the mixers' one signature)
        self.width, self.blocks = cfg.lru_width, cfg.lru_blocks
        if self.width % self.blocks:
            raise ValueError(f"the RG-LRU width {self.width} does not split into {self.blocks} blocks")
        super().__init__(self.width, cfg.lru_conv_kernel, (self.width,), conv_bias=True)
        block = self.width // self.blocks
        self.in_proj = nn.Linear(cfg.hidden_size, 2 * self.width, bias=True)  # x's rows, then y's
        # the gates' block-diagonal linears [blocks, in, out] (x @ W per block) and their biases
        self.input_gate = nn.Parameter(torch.zeros(self.blocks, block, block))
        self.input_gate_bias = nn.Parameter(torch.zeros(self.blocks, block))
        self.recurrent_gate = nn.Parameter(torch.zeros(self.blocks, block, block))
        self.recurrent_gate_bias = nn.Parameter(torch.zeros(self.blocks, block))
        self.recurrent_param = nn.Parameter(torch.zeros(self.width))
        self.act = activation(cfg.hidden_act)
        self.out_proj = nn.Linear(self.width, cfg.hidden_size, bias=True)

    def forward(self, x, rope: RotaryStep | None, attn: AttentionBackend, meta: AttentionMetadata,
                kv_cache: list, bf16: bool = False, rows: torch.Tensor | None = None, tokens: int | None = None):
        """As ``Attention.forward`` (``rope`` and ``kv_cache`` unused): every row's state advances, the output is
        ``rows``' only."""
        t = x.shape[0] if tokens is None else tokens
        u, y = self.in_proj(x)[:t].split([self.width, self.width], dim=-1)
        h = self.run_sequences(meta, u, [first_rows(meta, u)], self.width)
        out = h * self.act(y)
        return self.out_proj(out if rows is None else out[rows])

    def _gate(self, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """sigmoid of a block-diagonal linear of u [S, L, width] (float32)."""
        blocks = u.view(*u.shape[:2], self.blocks, -1)
        return torch.sigmoid(torch.einsum("slbi,bio->slbo", blocks, weight.float()) + bias.float()).flatten(2)

    def recurrence(self, u: torch.Tensor, first: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The RG-LRU over u [S, L, width] (after the convolution) from h [S, width]; ``first`` [S, L, 1] is 1 on a
        sequence's position 0. In float32: the outputs [S, L, width] (each row's state) and the state after."""
        uf = u.float()
        log_a = -8.0 * self._gate(uf, self.recurrent_gate, self.recurrent_gate_bias) * F.softplus(
            self.recurrent_param.float())
        scale = torch.sqrt(1 - torch.exp(2 * log_a))
        scale = torch.where(first.bool(), torch.ones_like(scale), scale)  # position 0: the input unscaled
        written = uf * self._gate(uf, self.input_gate, self.input_gate_bias) * scale
        a = torch.exp(log_a)
        out = []
        for i in range(u.shape[1]):
            h = a[:, i] * h + written[:, i]
            out.append(h)
        return torch.stack(out, dim=1), h


def first_rows(meta: AttentionMetadata, like: torch.Tensor) -> torch.Tensor:
    """[T, 1]: 1 on the rows at a sequence's position 0, else 0 (once a step, for every layer)."""
    memo = getattr(meta, "first_rows", None)
    if memo is not None:
        return memo
    first = torch.zeros(like.shape[0], 1, dtype=like.dtype, device=like.device)
    row = 0
    for seq in meta.seqs:
        if seq.start == 0:
            first[row] = 1
        row += len(seq.tokens)
    meta.first_rows = first  # type: ignore[attr-defined]
    return first
