"""From sequences to one ragged forward pass: flat token ids and positions, plus the attention
backend's metadata for them.

Both the target runner and the draft model's proposer lay out their steps with this:
single-token rows that extend a cached context (decodes) come first, sorted by context
length; multi-token rows (prefill chunks, speculative verification) follow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention import AttentionBackend, AttentionMetadata, SeqRows


@dataclass
class ForwardInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    order: list[int]  # indices into the given sequences, in the order their rows appear
    offsets: list[int]  # first row of each sequence (indexed like the given sequences)


def build_inputs(seqs: list[SeqRows], backend: AttentionBackend) -> ForwardInputs:
    decodes = sorted((i for i, s in enumerate(seqs) if s.is_decode), key=lambda i: seqs[i].end)
    order = decodes + [i for i, s in enumerate(seqs) if not s.is_decode]
    ids: list[int] = []
    pos: list[int] = []
    offsets = [0] * len(seqs)
    for i in order:
        s = seqs[i]
        offsets[i] = len(ids)
        ids.extend(s.tokens)
        pos.extend(range(s.start, s.end))
    meta = backend.build_metadata([seqs[i] for i in order], len(decodes))
    device = backend.device
    return ForwardInputs(torch.tensor(ids, device=device), torch.tensor(pos, device=device), meta, order, offsets)
