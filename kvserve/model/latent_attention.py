"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash, Kimi): q from a normed low-rank latent (or its own
projection), k and v expanded per head from another normed latent, and one rotary key every head shares.

The expanded heads are what the cache holds, as transformers computes them, so every attention backend runs it
unchanged: k = [rotary key, k's own part] and q alike (the rotary dims first, where partial rotary turns them), v
zero-padded to the cache's head_dim (and k and q where v is the wider), the padding cut from the output. Caching
the latent itself (vLLM's MLA backends, ~1/10 of these bytes at DeepSeek-V2-Lite's shapes) is not done.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.attention.backend import LayerAttention
from kvserve.model.config import ModelConfig
from kvserve.model.layers import RMSNorm
from kvserve.model.rotary import RotaryStep


class LatentAttention(nn.Module):
    plain = False  # the decoder's bf16 hand-offs are for ``Attention``'s layout
    sinks = None

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.heads, self.hidden_size = cfg.num_attention_heads, cfg.hidden_size
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.head_dim = int(cfg.head_dim or 0)  # the cache's
        self.latent, self.q_latent = cfg.kv_lora_rank, cfg.q_lora_rank
        qk = self.nope + self.rope
        q_rows = cfg.q_lora_rank or self.heads * qk
        self.split = (q_rows, cfg.kv_lora_rank, self.rope)
        self.qkv = nn.Linear(cfg.hidden_size, sum(self.split), bias=cfg.attention_bias)
        if cfg.q_lora_rank:
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b = nn.Linear(cfg.q_lora_rank, self.heads * qk, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b = nn.Linear(cfg.kv_lora_rank, self.heads * (self.nope + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * cfg.v_head_dim, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.interleaved = cfg.rope_interleaved  # the rotary dims in pairs (2i, 2i+1): reordered before rotary
        self.spec = LayerAttention(cfg.attn_scale, cfg.window(layer), cfg.attn_logit_softcap)

    def runs_bf16(self, *args) -> bool:
        return False

    def _rotary_first(self, pe: torch.Tensor, nope: torch.Tensor) -> torch.Tensor:
        """[rotary dims, the rest, zeros to head_dim]: one head layout for q and k (their dot products unchanged by
        the order), the rotary dims deinterleaved where the checkpoint pairs them."""
        if self.interleaved:
            pe = torch.cat([pe[..., 0::2], pe[..., 1::2]], -1)
        pad = self.head_dim - pe.shape[-1] - nope.shape[-1]
        parts = [pe, nope] + ([nope.new_zeros(*nope.shape[:-1], pad)] if pad else [])
        return torch.cat(parts, -1)

    def forward(self, x, rope: RotaryStep | None, attn: AttentionBackend, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor], bf16: bool = False, rows: torch.Tensor | None = None,
                tokens: int | None = None):
        """As ``Attention.forward`` (``bf16`` is never set: ``runs_bf16``)."""
        t = x.shape[0] if tokens is None else tokens
        q, latent, k_pe = self.qkv(x)[:t].split(self.split, dim=-1)
        if self.q_latent:
            q = self.q_b(self.q_norm(q.contiguous()))
        q = q.reshape(t, self.heads, self.nope + self.rope)
        kv = self.kv_b(self.kv_norm(latent.contiguous())).view(t, self.heads, self.nope + self.v_dim)
        k_nope, v = kv.split((self.nope, self.v_dim), dim=-1)
        q = self._rotary_first(q[..., self.nope:], q[..., : self.nope])
        k = self._rotary_first(k_pe.reshape(t, 1, self.rope).expand(t, self.heads, self.rope), k_nope)
        if rope is not None:
            q, k = rope.apply(q, k)
        if self.v_dim < self.head_dim:
            v = torch.cat([v, v.new_zeros(t, self.heads, self.head_dim - self.v_dim)], -1)
        o = attn.attend_layer(q, k, v.contiguous(), kv_cache, meta, self.spec, rows)
        if not o.shape[0]:  # no row attends (a step that samples nothing): the K/V writes were all
            return x.new_empty(0, self.hidden_size)
        o = o.reshape(o.shape[0], self.heads, -1)[..., : self.v_dim].reshape(o.shape[0], -1)
        return self.o_proj(o)
