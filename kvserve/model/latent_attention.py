"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash, Kimi): q from a normed low-rank latent (or its own
projection), k and v expanded per head from another normed latent, and one rotary key every head shares.

The expanded heads are what the cache holds, as transformers computes them, so every attention backend runs it
unchanged: k = [rotary key, k's own part] and q alike (the rotary dims first, where partial rotary turns them), v
zero-padded to the cache's head_dim (and k and q where v is the wider), the padding cut from the output. Caching
the latent itself (vLLM's MLA backends, ~1/10 of these bytes at DeepSeek-V2-Lite's shapes) is not done.

With a lightning indexer (DeepSeek-V3.2, GLM-5: ``ModelConfig.index_topk``) each query attends only its top-k keys by
the indexer's score: its keys go to the KV pool, and a step where some context is longer than top-k
attends on the general path with the choice as a mask (``attention.general.TopKKeys``); shorter contexts keep every
key, so the backends attend them as they are. The index keys are packed into pool layers after the model's own
(``kvserve.model.index_cache``): this layer's go to their place in each slot's row, the rest of the row kept.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.attention.backend import LayerAttention
from kvserve.attention.general import TopKKeys
from kvserve.kernels.ops import apply_rotary
from kvserve.model.config import ModelConfig
from kvserve.model.index_cache import index_slot
from kvserve.model.layers import LayerNorm, RMSNorm
from kvserve.model.rotary import RotaryStep


class LatentAttention(nn.Module):
    plain = False  # the decoder's bf16 hand-offs are for ``Attention``'s layout
    sinks = None

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.heads, self.hidden_size = cfg.attention_heads(layer), cfg.hidden_size
        q_latent, self.latent, self.nope, self.rope, self.v_dim = cfg.latent_dims(layer)
        self.head_dim = cfg.attn_head_dim(layer)  # the cache's
        self.q_latent = q_latent
        qk = self.nope + self.rope
        q_rows = q_latent or self.heads * qk
        self.split = (q_rows, self.latent, self.rope)
        self.qkv = nn.Linear(cfg.hidden_size, sum(self.split), bias=cfg.attention_bias)
        self.q_gate = cfg.latent_q_gate  # q_b reads [normed, raw] q latent, giving each head's q then its gate
        if q_latent:
            self.q_norm = RMSNorm(q_latent, cfg.rms_norm_eps)
            gate, cols = (self.v_dim, 2 * q_latent) if self.q_gate else (0, q_latent)
            self.q_b = nn.Linear(cols, self.heads * (qk + gate), bias=False)
        self.kv_norm = RMSNorm(self.latent, cfg.rms_norm_eps)
        self.rope_key_norm = RMSNorm(self.rope, cfg.rms_norm_eps) if cfg.latent_rope_key_norm else None
        self.kv_b = nn.Linear(self.latent, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, cfg.hidden_size, bias=cfg.o_proj_bias)
        # a sigmoid gate a head on the output (Dots 3's and Ling 3's g_proj)
        if cfg.attn_output_gate and not (cfg.attn_output_gate_per_head and cfg.attn_output_gate_fn == "sigmoid"):
            raise ValueError("latent attention's output gate is one sigmoid a head")
        self.gate = nn.Linear(cfg.hidden_size, self.heads, bias=False) if cfg.attn_output_gate else None
        self.interleaved = cfg.rope_interleaved  # the rotary dims in pairs (2i, 2i+1): reordered before rotary
        # the model's scale (YaRN's factor folded in) moved to this layer's q.k width where layers differ
        scale = cfg.attn_scale * ((cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) / qk) ** 0.5
        self.spec = LayerAttention(scale, cfg.window(layer), cfg.attn_logit_softcap)
        self.index_topk = cfg.index_topk if cfg.indexes(layer) else 0  # 0: no indexer
        self.own_index = cfg.runs_indexer(layer)  # False: the last indexer's choice reused (a step's TopKKeys)
        if self.own_index:
            self.index_heads, self.index_dim = cfg.index_heads, cfg.index_head_dim
            self.index_pairs = cfg.index_rope_interleaved
            _, self.index_half, self.index_offset = index_slot(cfg, layer)  # (the model hands it its pool layer)
            self.index_q = nn.Linear(cfg.q_lora_rank, cfg.index_heads * cfg.index_head_dim, bias=False)
            self.index_k = nn.Linear(cfg.hidden_size, cfg.index_head_dim, bias=False)
            self.index_k_norm = LayerNorm(cfg.index_head_dim, 1e-6)  # (the reference's eps, whatever rms_norm_eps)
            self.index_weights = nn.Linear(cfg.hidden_size, cfg.index_heads, bias=False)

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
        spec = self.spec
        if self.index_topk:
            kv_cache, index_cache = (kv_cache[0], kv_cache[1]) if self.own_index else (kv_cache, None)
        gate = None
        if self.q_latent:
            raw, q = q, self.q_norm(q.contiguous())
            if self.index_topk:
                select = self._choose_keys(x[:t], q, rope, attn, meta, index_cache)
                spec = spec if select is None else dataclasses.replace(spec, key_select=select)
            q = self.q_b(torch.cat([q, raw], -1) if self.q_gate else q)
            if self.q_gate:
                q, gate = q.view(t, self.heads, -1).split((self.nope + self.rope, self.v_dim), dim=-1)
        q = q.reshape(t, self.heads, self.nope + self.rope)
        kv = self.kv_b(self.kv_norm(latent.contiguous())).view(t, self.heads, self.nope + self.v_dim)
        if self.rope_key_norm is not None:
            k_pe = self.rope_key_norm(k_pe.contiguous())
        k_nope, v = kv.split((self.nope, self.v_dim), dim=-1)
        q = self._rotary_first(q[..., self.nope:], q[..., : self.nope])
        k = self._rotary_first(k_pe.reshape(t, 1, self.rope).expand(t, self.heads, self.rope), k_nope)
        if rope is not None:
            q, k = rope.apply(q, k)
        if self.v_dim < self.head_dim:
            v = torch.cat([v, v.new_zeros(t, self.heads, self.head_dim - self.v_dim)], -1)
        o = attn.attend_layer(q, k, v.contiguous(), kv_cache, meta, spec, rows)
        if not o.shape[0]:  # no row attends (a step that samples nothing): the K/V writes were all
            return x.new_empty(0, self.hidden_size)
        o = o.reshape(o.shape[0], self.heads, -1)[..., : self.v_dim]
        if self.gate is not None:  # one sigmoid a head
            g = self.gate(x[:t] if rows is None else x[:t][rows])
            o = o * torch.sigmoid(g.float()).to(o.dtype)[..., None]
        if gate is not None:  # one a value, from q_b (A.X-K2's)
            o = o * torch.sigmoid(gate if rows is None else gate[rows])
        return self.o_proj(o.reshape(o.shape[0], -1))

    def _rotate(self, x: torch.Tensor, rope: RotaryStep | None) -> torch.Tensor:
        """x [t, heads, dim] with its first rotary dims rotated (as halves; pairs deinterleaved first: q and k alike,
        so their dot products are unchanged)."""
        if rope is None:
            return x
        r = self.rope
        pe = x[..., :r]
        if self.index_pairs:
            pe = torch.cat([pe[..., 0::2], pe[..., 1::2]], -1)
        # (the native step holds the whole tables: latent attention's partial rotary never has one, but be safe)
        cos, sin = (rope.cos[rope.positions].unsqueeze(1), rope.sin[rope.positions].unsqueeze(1)) if rope.native \
            else (rope.cos, rope.sin)
        return torch.cat([apply_rotary(pe, cos[: x.shape[0], ..., :r], sin[: x.shape[0], ..., :r]), x[..., r:]], -1)

    def _choose_keys(self, x: torch.Tensor, q_latent: torch.Tensor, rope: RotaryStep | None, attn: AttentionBackend,
                     meta: AttentionMetadata, index_cache: tuple[torch.Tensor, torch.Tensor] | None) -> TopKKeys | None:
        """The step's choice of keys (this layer's indexer, or the last one's), with this layer's index keys stored;
        None where no context is longer than top-k (every query keeps all its keys)."""
        if self.own_index:
            assert index_cache is not None
            t = x.shape[0]
            queries = self._rotate(self.index_q(q_latent).view(t, self.index_heads, self.index_dim), rope)
            keys = self._rotate(self.index_k_norm(self.index_k(x)).view(t, 1, self.index_dim), rope)
            # the slots' rows as stored (other layers' keys in them), this layer's part replaced
            rows_kv = list(attn.pool.gather(index_cache, meta.slot_mapping, torch.float32))
            part = rows_kv[self.index_half].reshape(t, -1)
            part[:, self.index_offset : self.index_offset + self.index_dim] = keys.reshape(t, -1)
            attn.pool.store(index_cache, meta.slot_mapping, *rows_kv)
            weights = self.index_weights(x).float() * self.index_heads ** -0.5
            # kept on the step's metadata for the layers that reuse this choice
            meta.__dict__["_index_choice"] = TopKKeys(queries, weights, index_cache, self.index_topk,
                                                      self.index_dim ** -0.5, self.index_half, self.index_offset)
        if max(s.end for s in meta.seqs) <= self.index_topk:
            return None
        return meta.__dict__["_index_choice"]
