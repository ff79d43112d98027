"""From sequences to one ragged forward pass: flat token ids, positions and attention metadata.

Both the target runner and the draft model's proposer lay out their steps with this:
single-token rows that extend a cached context (decodes) come first, sorted and grouped
by context length; multi-token rows (prefill chunks, speculative verification) follow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.model.attention import AttentionMetadata, DecodeGroup, PrefillSpan


@dataclass
class SeqRows:
    """``tokens`` of one sequence go through the model at positions ``start``.. ; the KV of
    positions < start is in the cache, reached through ``block_table``."""

    tokens: list[int]
    start: int
    block_table: list[int]

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def is_decode(self) -> bool:
        return len(self.tokens) == 1 and self.start > 0


@dataclass
class ForwardInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    order: list[int]  # indices into the given sequences, in the order their rows appear
    offsets: list[int]  # first row of each sequence (indexed like the given sequences)


def build_inputs(seqs: list[SeqRows], block_size: int, null_slot: int, device: torch.device) -> ForwardInputs:
    decodes = sorted((i for i, s in enumerate(seqs) if s.is_decode), key=lambda i: seqs[i].end)
    prefills = [i for i, s in enumerate(seqs) if not s.is_decode]
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    offsets = [0] * len(seqs)
    for row, i in enumerate(decodes):
        s = seqs[i]
        ids.append(s.tokens[0])
        pos.append(s.start)
        offsets[i] = row
    meta = AttentionMetadata(slot_mapping=torch.empty(0), num_decodes=len(decodes))
    start = 0
    for end in _decode_group_ends([seqs[i].end for i in decodes]):
        group = [seqs[i] for i in decodes[start:end]]
        ctx = torch.tensor([s.end for s in group], device=device)
        width = max(len(s.block_table) for s in group)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in group], device=device)
        p = torch.arange(int(ctx.max()), device=device)
        valid = p.unsqueeze(0) < ctx.unsqueeze(1)
        g_slots = torch.where(valid, tables[:, p // block_size] * block_size + p % block_size, null_slot)
        meta.decode_groups.append(DecodeGroup(start, end, g_slots, valid[:, None, None, :]))
        slots.extend(g_slots[torch.arange(len(group), device=device), ctx - 1].tolist())
        start = end
    row = len(decodes)
    for i in prefills:
        s = seqs[i]
        offsets[i] = row
        ids.extend(s.tokens)
        pos.extend(range(s.start, s.end))
        slots.extend(_slots(s.block_table, block_size, s.start, s.end))
        span = PrefillSpan(q_start=row, num_tokens=len(s.tokens))
        if s.start > 0:
            span.context_slots = torch.tensor(_slots(s.block_table, block_size, 0, s.end), device=device)
            k_pos = torch.arange(s.end, device=device).unsqueeze(0)
            q_pos = torch.arange(s.start, s.end, device=device).unsqueeze(1)
            span.mask = k_pos <= q_pos
        meta.prefills.append(span)
        row += len(s.tokens)
    meta.slot_mapping = torch.tensor(slots, device=device)
    return ForwardInputs(torch.tensor(ids, device=device), torch.tensor(pos, device=device), meta,
                         decodes + prefills, offsets)


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
