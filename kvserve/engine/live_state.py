"""What the engine is doing right now, for a person watching: ``EngineState`` and ``capture_state``.

Built only when a client asks (the server's live view, ``kvserve/server/engine_view.py``, asks at
most five times a second), between two steps, and bounded: at most ``max_requests`` requests per
queue and a capped walk of the prefix tree (``kvserve.kv.prefix_view``), which the engine core
redoes at most once a second, so a large engine pays milliseconds, not a walk over everything. Counters that grow forever (tokens, hits,
preemptions) are not here: every step message already carries them (``EngineStatsSnapshot``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.kv.prefix_view import PrefixTreeView, summarize

if TYPE_CHECKING:
    from kvserve.engine.engine import Engine
    from kvserve.engine.request import Request

MAX_REQUESTS = 64


@dataclass
class RequestView:
    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int  # how far the KV cache covers prompt + output (the prefill's progress)
    num_cached_tokens: int  # prompt tokens found in the prefix cache
    num_output_tokens: int
    max_output_tokens: int  # max_tokens, or what the context window leaves
    num_preemptions: int
    age_s: float  # since it arrived at the engine


@dataclass
class KVBlocks:
    """The pool's blocks, split the three ways that add up to its size."""

    total: int
    used: int  # held by sequences (shared ones once)
    cached: int  # held by the prefix tree alone: reusable, and evictable when space runs short
    free: int


@dataclass
class EngineState:
    running: list[RequestView]
    waiting: list[RequestView]
    num_running: int
    num_waiting: int
    blocks: KVBlocks
    block_size: int
    tiers: list[str]  # the offload tiers behind the device cache (host, disk, redis)
    prefix_tree: PrefixTreeView | None  # None when prefix caching is off
    capture_ms: float = 0.0  # what building this cost the engine


def _view(req: Request, now: float) -> RequestView:
    left = max(0, req.max_total_tokens - req.num_prompt_tokens)
    max_out = min(req.params.max_tokens, left) if req.params.max_tokens is not None else left
    return RequestView(req.request_id, req.num_prompt_tokens, req.num_computed_tokens, req.num_cached_tokens,
                       req.num_output_tokens, max_out, req.num_preemptions, max(0.0, now - req.arrival_time))


def capture_state(engine: Engine, *, max_requests: int = MAX_REQUESTS, tree: PrefixTreeView | None = None) -> EngineState:
    """The engine's requests, blocks and prefix tree now (bounded; see the module docstring).
    ``tree``: a recent summary of the prefix tree to reuse instead of walking it again."""
    start = engine.clock()
    s, kv = engine.scheduler, engine.kv
    pool = kv.pool
    waiting = [r for _, r in zip(range(max_requests), s.waiting)]  # a deque: no slicing
    blocks = KVBlocks(pool.num_blocks, pool.num_blocks - pool.num_free - pool.num_evictable, pool.num_evictable,
                      pool.num_free)
    if tree is None and kv.cache is not None:
        tree = summarize(kv.cache)
    state = EngineState([_view(r, start) for r in s.running[:max_requests]], [_view(r, start) for r in waiting],
                        s.num_running, s.num_waiting, blocks, kv.block_size, [t.name for t in kv.tiers.tiers], tree)
    state.capture_ms = (engine.clock() - start) * 1000
    return state
