"""Attention whose query and output projections are routed experts (JetMoE's mixture of attention heads): a router
picks each token's top ``num_experts_per_tok`` of ``attention_experts`` experts (a softmax over the chosen logits);
each chosen expert projects the token's queries for the K/V heads (one query head per K/V head), which share one
k/v projection, so a token has top_k x K/V heads query heads; each expert's output projection maps its heads back,
weighted by its gate, and a bias is added to the sum. Torch only (the native decode stack does not run it)."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.attention.backend import LayerAttention
from kvserve.model.config import ModelConfig
from kvserve.model.rotary import RotaryStep


class RoutedQueryAttention(nn.Module):
    plain = False  # (DecoderLayer's bf16 hand-offs are plain attention's)

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.experts, self.top_k = cfg.attention_experts, cfg.num_experts_per_tok
        self.kv_heads, self.head_dim = cfg.num_key_value_heads, int(cfg.head_dim or 0)
        width = self.kv_heads * self.head_dim  # one expert's queries (and its output projection's input)
        self.hidden_size = cfg.hidden_size
        self.router = nn.Linear(cfg.hidden_size, self.experts, bias=False)
        self.q_experts = nn.Parameter(torch.empty(self.experts, width, cfg.hidden_size))
        self.o_experts = nn.Parameter(torch.empty(self.experts, cfg.hidden_size, width))
        self.o_bias = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.kv_proj = nn.Linear(cfg.hidden_size, 2 * width, bias=False)
        self.spec = LayerAttention(cfg.attn_scale, cfg.window(layer), cfg.attn_logit_softcap, chunk=cfg.chunk(layer))

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's chosen experts [t, top_k] (best first) and their gates (a softmax over the chosen logits, in
        float32 as the checkpoints' router computes it)."""
        logits, chosen = self.router(x).float().topk(self.top_k, dim=-1)
        return chosen, torch.softmax(logits, dim=-1).to(x.dtype)

    def forward(self, x: torch.Tensor, rope: RotaryStep | None, attn: AttentionBackend, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor], bf16: bool = False, rows: torch.Tensor | None = None,
                tokens: int | None = None) -> torch.Tensor:
        """As ``Attention.forward`` (``bf16`` is never asked of it: it is not ``plain``)."""
        t = x.shape[0] if tokens is None else tokens
        x = x[:t]
        chosen, gates = self._route(x)
        q = x.new_empty(t, self.top_k, self.kv_heads * self.head_dim)
        for e in chosen.unique().tolist():  # each expert over the rows (and slots) that chose it
            r, slot = (chosen == e).nonzero(as_tuple=True)
            q[r, slot] = x[r] @ self.q_experts[e].t()
        # query head (K/V head h, slot j) at h x top_k + j: the K/V head of a query head is its index // top_k
        q = q.view(t, self.top_k, self.kv_heads, self.head_dim).transpose(1, 2).reshape(t, -1, self.head_dim)
        k, v = self.kv_proj(x).view(t, 2, self.kv_heads, self.head_dim).unbind(1)
        if rope is not None:
            q, k = rope.apply(q, k.contiguous())
        o = attn.attend_layer(q, k, v.contiguous(), kv_cache, meta, self.spec, rows)
        if not o.shape[0]:
            return x.new_empty(0, self.hidden_size)
        n = o.shape[0]
        o = o.reshape(n, self.kv_heads, self.top_k, self.head_dim).transpose(1, 2).reshape(n, self.top_k, -1)
        if rows is not None:
            chosen, gates = chosen[rows], gates[rows]
        out = o.new_zeros(n, self.hidden_size)
        for e in chosen.unique().tolist():
            r, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, r, (o[r, slot] @ self.o_experts[e].t()) * gates[r, slot, None])
        return out + self.o_bias
