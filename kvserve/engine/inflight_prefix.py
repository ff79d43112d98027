"""Prompts that overlap a prefix still being computed: which blocks a request being admitted can share
with a chunk of the step being built, and whether it should wait for a prefill that runs on.

Without these, requests that arrive together on one long prefix (a burst of questions on one
document) would each compute it. A chunk of the step that fills the same blocks lends them at
once: every layer writes all rows' K/V before any row reads the cache, so the sharer's rows see
them in that same step. What a chunk fills only in later steps is waited for instead (SGLang's
in-batch prefix check).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvserve.engine.batch import ScheduledChunk
from kvserve.engine.request import Request
from kvserve.kv.block_pool import NO_BLOCK


def blocks_filled_this_step(chunks: Sequence[ScheduledChunk], req: Request, cached: int, block_size: int,
                            table: Callable[[str], list[int]]) -> list[int]:
    """Full blocks past the first ``cached`` tokens of ``req``'s prompt that one of ``chunks`` (a prefill
    chunk already in the step) fills with the same tokens, at most all but the prompt's last token
    (whose logits ``req`` needs); ``table(request_id)``: a request's block table. The longest such run."""
    bs, first = block_size, cached // block_size
    limit = (req.num_prompt_tokens - 1) // bs  # blocks req may take over
    best: list[int] = []
    for c in chunks:
        other = c.request
        end = min(c.end // bs, limit, other.num_prompt_tokens // bs)
        if end - first <= len(best) or c.is_decode or other.cache_seed != req.cache_seed:  # another adapter's KV
            continue
        mine, theirs = req.token_ids, other.token_ids
        if mine[first * bs : (first + 1) * bs] != theirs[first * bs : (first + 1) * bs] or mine[:cached] != theirs[:cached]:
            continue
        n = first
        while n < end and mine[n * bs : (n + 1) * bs] == theirs[n * bs : (n + 1) * bs]:
            n += 1
        # a block a sliding window let go of (behind the other's chunk) cannot be lent
        if n - first > len(best) and NO_BLOCK not in (blocks := table(other.request_id)[first:n]):
            best = blocks
    return best


def prefix_being_computed(running: Iterable[Request], req: Request, cached: int, block_size: int) -> bool:
    """Whether a running request still prefilling shares at least one more full block with ``req``
    than the first ``cached`` tokens (then ``req`` waits for it rather than compute it too)."""
    bs = block_size
    want = req.token_ids[: req.num_prompt_tokens - 1]
    for r in running:
        if r.num_computed_tokens >= r.num_prompt_tokens or r.cache_seed != req.cache_seed:
            continue
        if cached + bs > min(len(want), r.num_prompt_tokens):
            continue
        if want[cached : cached + bs] == r.token_ids[cached : cached + bs] and want[:cached] == r.token_ids[:cached]:
            return True
    return False
