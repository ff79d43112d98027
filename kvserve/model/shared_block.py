"""Transformer blocks shared between layers (Zamba, Zamba2: ``ModelConfig.shared_block_layers``).

A few blocks' weights (``SharedBlock``) serve many layers: before such a layer's mixer the block reads the residual
stream beside the model's embeddings, [stream, embeddings] (twice the hidden size), normed; attends over it with heads
spanning the doubled width (o_proj back to the hidden size); norms that and runs its gated MLP, with no residual inside.
Each use (``SharedBlockUse``, owned by its layer) has its own K/V (the layer's pool layer), its own low-rank adapters
added to q/k/v and to the MLP's gate/up (each use of a block differs only by them), and its own linear mapping the
block's output onto the mixer's input.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.model.attention import Attention
from kvserve.model.config import ModelConfig
from kvserve.model.layers import RMSNorm
from kvserve.model.mlp import GatedMLP
from kvserve.model.rotary import RotaryStep


class SharedBlock(nn.Module):
    """One shared block's weights: the norm over [stream, embeddings], attention over that width, the MLP's norm and
    the gated MLP."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(2 * h, cfg.rms_norm_eps)
        # attention built over the doubled width, its output projected back to the stream's
        self.attention = Attention(dataclasses.replace(cfg, hidden_size=2 * h), layer)
        self.attention.o_proj = nn.Linear(self.attention.num_heads * self.attention.head_dim, h, bias=cfg.o_proj_bias)
        self.attention.hidden_size = h
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = GatedMLP(h, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias)


class SharedBlockUse(nn.Module):
    """A layer's use of a shared block: its adapters (a down projection to the rank, then an up projection each) and
    the linear onto the mixer's input."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, r = cfg.hidden_size, cfg.shared_block_adapter_rank
        d = int(cfg.head_dim or 0)
        self.rank = r
        self.qkv_down: nn.Linear | None = None
        if r and cfg.shared_block_qkv_adapters:
            self.qkv_down = nn.Linear(2 * h, 3 * r, bias=False)  # q's, k's and v's down projections stacked
            self.q_up = nn.Linear(r, cfg.num_attention_heads * d, bias=False)
            self.k_up = nn.Linear(r, cfg.num_key_value_heads * d, bias=False)
            self.v_up = nn.Linear(r, cfg.num_key_value_heads * d, bias=False)
        self.gate_up_down = nn.Linear(h, r, bias=False) if r else None
        self.gate_up_up = nn.Linear(r, 2 * cfg.intermediate_size, bias=False) if r else None
        self.out_proj = nn.Linear(h, h, bias=False)

    def forward(self, block: SharedBlock, h: torch.Tensor, embeds: torch.Tensor, rope: RotaryStep | None,
                attn: AttentionBackend, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        """The block's output for every row of the step [T, hidden], mapped by this use's linear (every row: the mixer
        after it reads them all); this use's K/V written to ``kv_cache``."""
        x = block.input_layernorm(torch.cat([h, embeds], dim=-1))
        extra_qkv = None
        if self.qkv_down is not None:
            dq, dk, dv = self.qkv_down(x).split(self.rank, dim=-1)
            extra_qkv = torch.cat([self.q_up(dq), self.k_up(dk), self.v_up(dv)], dim=-1)
        a = block.attention(x, rope, attn, meta, kv_cache, extra_qkv=extra_qkv)
        a = block.post_attention_layernorm(a)
        extra = None if self.gate_up_down is None else self.gate_up_up(self.gate_up_down(a))  # type: ignore[misc]
        return self.out_proj(block.mlp(a, extra_gate_up=extra))
