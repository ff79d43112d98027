"""Paged attention over a ragged batch: decodes batched together, prefill chunks one by one.

The KV cache of a layer is two tensors [num_slots, kv_heads, head_dim]; a slot is
``block_id * block_size + offset``. New keys and values are written to their slots first,
then each sequence reads its whole context back through its block table (as slot indices).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """A prefill chunk: rows [q_start, q_start + num_tokens) of the batch, at positions start.."""

    q_start: int
    num_tokens: int
    # None when the chunk starts the sequence: attend to the fresh keys with a causal mask
    context_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # [num_tokens, context] bool, causal with an offset


@dataclass
class DecodeGroup:
    """Decode rows [start, end) with contexts of similar length, gathered and attended together."""

    start: int
    end: int
    slots: torch.Tensor  # [rows, max_context of the group]; padding points at the null slot
    mask: torch.Tensor  # [rows, 1, 1, max_context] bool


@dataclass
class AttentionMetadata:
    """Built once per step by the runner and shared by every layer."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decodes: int = 0  # the first num_decodes rows are single-token decodes
    decode_slots: torch.Tensor | None = None  # [num_decodes, max_context] (padding points at slot 0)
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_context] bool
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64
    # Decodes split by context length, so one long sequence does not make every other decode in the
    # step gather (and attend over) padding up to its length. Empty: one group, decode_slots/mask.
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """Per layer, K and V tensors for ``num_blocks`` blocks plus one zeroed block past the pool; returns
    them and the first slot of that extra block. Padded attention reads point there, so the rest of
    the cache can stay uninitialised (never read before it is written) and the OS maps its pages
    only as they fill."""
    null_slot = num_blocks * block_size
    shape = ((num_blocks + 1) * block_size, kv_heads, head_dim)
    caches = []
    for _ in range(num_layers):
        k, v = (torch.empty(shape, dtype=dtype, device=device) for _ in range(2))
        k[null_slot:].zero_()
        v[null_slot:].zero_()
        caches.append((k, v))
    return caches, null_slot


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """q: [T, heads, d]; k, v: [T, kv_heads, d] for the new tokens. Returns [T, heads, d]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    gqa = q.shape[1] != k.shape[1]
    if meta.num_decodes == q.shape[0] and not meta.prefills:
        return _decode(q, k_cache, v_cache, meta, gqa)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, meta, gqa)
    for span in meta.prefills:
        rows = slice(span.q_start, span.q_start + span.num_tokens)
        qs = q[rows].transpose(0, 1).unsqueeze(0)
        if span.context_slots is None:
            ks, vs = k[rows], v[rows]
        else:
            ks, vs = k_cache[span.context_slots], v_cache[span.context_slots]
        o = F.scaled_dot_product_attention(
            qs,
            ks.transpose(0, 1).unsqueeze(0),
            vs.transpose(0, 1).unsqueeze(0),
            attn_mask=span.mask,
            is_causal=span.mask is None,
            enable_gqa=gqa,
        )
        out[rows] = o[0].transpose(0, 1)
    return out


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, gqa: bool) -> torch.Tensor:
    groups = meta.decode_groups or [DecodeGroup(0, q.shape[0], meta.decode_slots, meta.decode_mask)]
    if len(groups) == 1:
        return _decode_group(q, k_cache, v_cache, groups[0], gqa)
    out = torch.empty_like(q)
    for g in groups:
        out[g.start : g.end] = _decode_group(q[g.start : g.end], k_cache, v_cache, g, gqa)
    return out


def _decode_group(q, k_cache, v_cache, g: DecodeGroup, gqa: bool) -> torch.Tensor:
    # Gather each sequence's context through its block table: [B, L, kv_heads, d].
    kd = k_cache[g.slots].transpose(1, 2)
    vd = v_cache[g.slots].transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=g.mask, enable_gqa=gqa)
    return o.squeeze(2)
