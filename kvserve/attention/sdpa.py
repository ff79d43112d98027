"""The gather-sdpa attention backend (auto's choice off the CPU or without the native kernels):
gather each sequence's KV, then torch SDPA.

New keys and values are written to their slots first (through the pool, which quantizes for an
8-bit cache); then each sequence reads its whole context back through its block table (as slot
indices; an 8-bit cache dequantizes just those slots). Decodes are batched in groups of
similar context length; prefill chunks attend one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.attention.backend import AttentionBackend, AttentionMetadata, SeqRows, register_attention_backend
from kvserve.attention.kv_pool import KVPool, LayerKV
from kvserve.errors import InvalidArgumentError


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
class SdpaMetadata(AttentionMetadata):
    num_decodes: int = 0  # the first num_decodes rows are single-token decodes
    # Decodes split by context length, so one long sequence does not make every other decode in the
    # step gather (and attend over) padding up to its length.
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)


class GatherSdpaBackend(AttentionBackend):
    def __init__(self, pool: KVPool, model_dtype: torch.dtype):
        super().__init__(pool, model_dtype)
        if pool.dtype != model_dtype and not pool.converts_on_read:  # others give back the dtype asked for
            raise InvalidArgumentError(f"the gather-sdpa attention backend reads the KV cache in the model's dtype "
                                       f"({model_dtype}), and this KV cache stores {pool.dtype}", param="kv_cache_dtype")

    def build_metadata(self, seqs: Sequence[SeqRows], num_decodes: int) -> SdpaMetadata:
        device, bs, null_slot = self.device, self.pool.block_size, self.pool.null_slot
        decodes = seqs[:num_decodes]
        slots: list[int] = []
        groups: list[DecodeGroup] = []
        start = 0
        for end in _decode_group_ends([s.end for s in decodes]):
            group = decodes[start:end]
            ctx = torch.tensor([s.end for s in group], device=device)
            width = max(len(s.block_table) for s in group)
            tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in group], device=device)
            p = torch.arange(int(ctx.max()), device=device)
            valid = p.unsqueeze(0) < ctx.unsqueeze(1)
            g_slots = torch.where(valid, tables[:, p // bs] * bs + p % bs, null_slot)
            groups.append(DecodeGroup(start, end, g_slots, valid[:, None, None, :]))
            slots.extend(g_slots[torch.arange(len(group), device=device), ctx - 1].tolist())
            start = end
        prefills: list[PrefillSpan] = []
        row = num_decodes
        for s in seqs[num_decodes:]:
            slots.extend(_slots(s.block_table, bs, s.start, s.end))
            span = PrefillSpan(q_start=row, num_tokens=len(s.tokens))
            if s.start > 0:
                span.context_slots = torch.tensor(_slots(s.block_table, bs, 0, s.end), device=device)
                k_pos = torch.arange(s.end, device=device).unsqueeze(0)
                q_pos = torch.arange(s.start, s.end, device=device).unsqueeze(1)
                span.mask = k_pos <= q_pos
            prefills.append(span)
            row += len(s.tokens)
        return SdpaMetadata(slot_mapping=torch.tensor(slots, device=device), seqs=seqs, num_decodes=num_decodes,
                            decode_groups=groups, prefills=prefills)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer_kv: LayerKV, meta: SdpaMetadata, scale: float | None = None) -> torch.Tensor:  # type: ignore[override]
        self.pool.store(layer_kv, meta.slot_mapping, k, v)
        gqa = q.shape[1] != k.shape[1]
        if meta.num_decodes == q.shape[0] and not meta.prefills:
            return self._decode(q, layer_kv, meta, gqa, scale)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], layer_kv, meta, gqa, scale)
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_start + span.num_tokens)
            qs = q[rows].transpose(0, 1).unsqueeze(0)
            if span.context_slots is None:
                ks, vs = self.pool.as_stored(layer_kv, k[rows], v[rows])
            else:
                ks, vs = self.pool.gather(layer_kv, span.context_slots, q.dtype)
            o = F.scaled_dot_product_attention(
                qs,
                ks.transpose(0, 1).unsqueeze(0),
                vs.transpose(0, 1).unsqueeze(0),
                attn_mask=span.mask,
                is_causal=span.mask is None,
                enable_gqa=gqa,
                scale=scale,
            )
            out[rows] = o[0].transpose(0, 1)
        return out


    def _decode(self, q: torch.Tensor, layer_kv: LayerKV, meta: SdpaMetadata, gqa: bool,
                scale: float | None = None) -> torch.Tensor:
        groups = meta.decode_groups
        if len(groups) == 1:
            return self._decode_group(q, layer_kv, groups[0], gqa, scale)
        out = torch.empty_like(q)
        for g in groups:
            out[g.start : g.end] = self._decode_group(q[g.start : g.end], layer_kv, g, gqa, scale)
        return out

    def _decode_group(self, q: torch.Tensor, layer_kv: LayerKV, g: DecodeGroup, gqa: bool,
                      scale: float | None = None) -> torch.Tensor:
        # Gather each sequence's context through its block table: [B, L, kv_heads, d].
        kd, vd = self.pool.gather(layer_kv, g.slots, q.dtype)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=g.mask,
                                           enable_gqa=gqa, scale=scale)
        return o.squeeze(2)


register_attention_backend("gather-sdpa", GatherSdpaBackend)


def _slots(table: list[int], bs: int, lo: int, hi: int) -> list[int]:
    return [table[p // bs] * bs + p % bs for p in range(lo, hi)]


def _decode_group_ends(contexts: list[int]) -> list[int]:
    """Cut the decodes (sorted by context length) where padding the next one's group to its
    length would more than double the group's shortest context (and cost a gather of at least
    a few blocks): bounds the wasted gather to 2x while keeping groups few."""
    ends: list[int] = []
    lo = None
    for i, end in enumerate(contexts):
        if lo is None:
            lo = end
        elif end > 2 * lo and end - lo > 256:
            ends.append(i)
            lo = end
    if contexts:
        ends.append(len(contexts))
    return ends
