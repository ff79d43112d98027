"""One engine request seen from the API process: an async iterator of RequestOutputs."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Protocol

from kvserve.engine.messages import RequestDelta
from kvserve.text.output import RequestOutput
from kvserve.engine.request import FinishReason

if TYPE_CHECKING:
    from kvserve.server.engine_client import AsyncEngineClient


class RequestObserver(Protocol):
    """What the client reports per request (the server's metrics implement it)."""

    def on_handoff(self, seconds: float) -> None: ...
    def on_first_token(self, ttft: float, num_prompt_tokens: int, num_cached_tokens: int) -> None: ...
    def on_tokens(self, inter_token_latency: float, num_tokens: int) -> None: ...
    def on_finish(self, finish_reason: str, e2e_latency: float) -> None: ...


class RequestStream:
    """Deltas of one request, turned into RequestOutputs by the client's OutputProcessor.

    Each ``__anext__`` takes every delta that arrived since the last one, so a consumer
    that falls behind gets its tokens in a group rather than one chunk per token.
    """

    def __init__(self, client: AsyncEngineClient, request_id: str, arrival_time: float):
        self.client = client
        self.request_id = request_id
        self.arrival_time = arrival_time
        # (engine step end time, delta), or the error that ends the request
        self.queue: asyncio.Queue[tuple[float, RequestDelta] | BaseException] = asyncio.Queue()
        self.finished = False
        self._last_token_time: float | None = None
        self.trace: Any = None  # a kvserve.server.tracing.RequestTrace when requests are traced

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        try:
            return self._apply(items)
        except BaseException as e:
            self.finished = True
            self.client._forget(self.request_id)
            if self.trace is not None:
                self.trace.fail(type(e).__name__)
            raise

    def _apply(self, items: list[tuple[float, RequestDelta] | BaseException]) -> RequestOutput:
        now = time.monotonic()
        obs = self.client.observer
        deltas: list[RequestDelta] = []
        for item in items:
            if isinstance(item, BaseException):
                raise item
            step_end, delta = item
            if obs is not None:
                obs.on_handoff(now - step_end)
            if self.trace is not None:
                self.trace.on_delta(step_end, delta)
            deltas.append(delta)
        num_new = sum(len(d.new_token_ids) for d in deltas)
        out, stopped = self.client.processor.apply(self.request_id, deltas)
        if stopped:  # a stop string ended it here; the engine still thinks it runs
            self.client._abort_in_engine(self.request_id)
        if obs is not None and num_new:
            if self._last_token_time is None:
                obs.on_first_token(now - self.arrival_time, out.num_prompt_tokens, out.num_cached_tokens)
            else:
                obs.on_tokens((now - self._last_token_time) / num_new, num_new)
        if num_new:
            self._last_token_time = now
        if out.finished:
            self.finished = True
            self.client._forget(self.request_id)
            if obs is not None:
                obs.on_finish(out.finish_reason or "stop", now - self.arrival_time)
            if self.trace is not None:
                self.trace.finish(out)
        return out

    def abort(self) -> None:
        """Stop the request now (client went away); a no-op once it finished."""
        if not self.finished:
            self.finished = True
            self.client.abort(self.request_id)
            if self.client.observer is not None:
                self.client.observer.on_finish(FinishReason.ABORT.value, time.monotonic() - self.arrival_time)
            if self.trace is not None:
                self.trace.fail("aborted")
