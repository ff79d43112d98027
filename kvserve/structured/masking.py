"""A step's grammar work in the runner: mask the scored logits of constrained requests before
sampling, then advance each grammar by the tokens the step produced for its request."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.engine.batch import ScheduledChunk
from kvserve.structured.matcher import allocate_bitmask, apply_masks


def apply_grammar_masks(logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> dict[str, int]:
    """Mask the scored rows of constrained requests to what their grammar allows (``logits``
    holds each chunk's rows in turn: one, or 1 + k for a verify). A draft is checked first: the
    grammar's valid prefix of it is verified, each of its rows masked with the grammar state
    after the drafts before it. Returns {request id: drafts kept} for cut drafts."""
    if all(c.request.grammar is None for c in chunks):
        return {}
    bitmask = allocate_bitmask(logits.shape[0], logits.shape[1])
    masked: list[int] = []
    kept: dict[str, int] = {}
    row = 0
    for c in chunks:
        m, drafts = c.request.grammar, c.draft_token_ids
        if m is not None and not m.is_terminated():
            k = m.validate_tokens(drafts) if drafts else 0
            taken = 0
            for j in range(k + 1):
                if m.is_terminated():  # a drafted stop token: the rows after it are not verified
                    k = j
                    break
                m.fill_mask(bitmask, row + j)
                masked.append(row + j)
                if j < k:
                    m.accept(drafts[j])
                    taken += 1
            m.rollback(taken)
            if k < len(drafts):
                kept[c.request.request_id] = k
        row += 1 + len(drafts)
    apply_masks(logits, bitmask, masked)
    return kept


def advance_grammars(chunks: Sequence[ScheduledChunk], token_ids: dict[str, list[int]]) -> None:
    """The grammars take the tokens sampled under their masks (up to a stop or a refusal)."""
    for c in chunks:
        m = c.request.grammar
        if m is not None:
            for t in token_ids[c.request.request_id]:
                if m.is_terminated() or not m.accept(t):
                    break
