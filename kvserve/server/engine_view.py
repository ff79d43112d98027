"""The web page's live view of the engine: ``EngineView`` makes one ``EngineFrame`` at a time.

A frame is the engine's live state (``EngineState``: requests with their progress, KV blocks, the
prefix tree's largest prefixes), asked of the engine between two of its steps, plus the counters
of its latest stats snapshot and rates over the last few seconds. However many pages watch, the
engine is asked at most once per ``min_interval``: watchers share the latest frame (the live view's
stream asks every 0.25 s at the most, so each of its frames is fresh).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from kvserve.engine.live_state import EngineState
from kvserve.server.engine_client import EngineClient

MIN_INTERVAL_S = 0.2
RATE_WINDOW_S = 5.0


@dataclass
class PrefixHits:
    """Prompt tokens looked up in the prefix cache since start, and where they were found."""

    queried_tokens: int
    hit_tokens: int
    by_tier: dict[str, int]  # "device", then each offload tier: tokens found there


@dataclass
class SpecCounts:
    method: str | None  # None: speculation is off
    verifies: int
    draft_tokens: int
    accepted_tokens: int


@dataclass
class EngineFrame:
    time: float  # Unix time
    model: str
    alive: bool
    num_in_flight: int  # requests the server holds (some may be on their way to the engine)
    prompt_tokens: int  # since start
    generation_tokens: int
    preemptions: int
    prompt_tokens_per_s: float  # over the last RATE_WINDOW_S seconds
    generation_tokens_per_s: float
    prefix: PrefixHits
    spec: SpecCounts
    state: EngineState | None  # None while the engine does not answer
    resident_memory_bytes: int | None = None


class EngineView:
    def __init__(self, client: EngineClient, model: str, *, min_interval: float = MIN_INTERVAL_S):
        self.client = client
        self.model = model
        self.min_interval = min_interval
        self._lock = asyncio.Lock()
        self._frame: EngineFrame | None = None
        self._frame_at = 0.0
        self._samples: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens, generation tokens)

    async def frame(self) -> EngineFrame:
        """The latest frame, made now unless one younger than ``min_interval`` exists."""
        async with self._lock:
            asked = time.monotonic()
            if self._frame is not None and asked - self._frame_at < self.min_interval:
                return self._frame
            state = await self.client.fetch_state()
            self._frame, self._frame_at = self._make(state), asked
            return self._frame

    def _make(self, state: EngineState | None) -> EngineFrame:
        c, s = self.client, self.client.stats
        now = time.monotonic()
        self._samples.append((now, s.prompt_tokens, s.generation_tokens))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.popleft()
        t0, p0, g0 = self._samples[0]
        span = now - t0
        pc = s.prefix_cache
        tiers = state.tiers if state is not None else [k for k, v in pc.tier_hits.items() if v]
        spec = c.config.speculation
        return EngineFrame(
            time=time.time(), model=self.model, alive=c.is_alive, num_in_flight=c.num_in_flight,
            prompt_tokens=s.prompt_tokens, generation_tokens=s.generation_tokens, preemptions=s.num_preemptions,
            prompt_tokens_per_s=(s.prompt_tokens - p0) / span if span > 0 else 0.0,
            generation_tokens_per_s=(s.generation_tokens - g0) / span if span > 0 else 0.0,
            prefix=PrefixHits(pc.queries, pc.hits, {"device": pc.device_hits,
                                                    **{t: pc.tier_hits.get(t, 0) for t in tiers}}),
            spec=SpecCounts(spec.speculative_method, s.spec.num_verifies, s.spec.num_draft_tokens,
                            s.spec.num_accepted_tokens),
            state=state, resident_memory_bytes=s.resident_memory_bytes)
