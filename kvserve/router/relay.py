"""A backend's event stream passed through to the client, byte for byte (``RelayResponse``).

The router has read the stream's first chunk before answering (so that a backend that fails
before its first byte can be replaced); the rest goes out as it comes. What the router needs from
the stream it learns without holding it up: the usage's ``cached_tokens`` (for its metrics), and
whether the bytes so far end between two events. If the backend breaks the stream, the client gets
an error event in OpenAI's shape (ending the event in progress first) and ``data: [DONE]``. The
upstream response is closed, and the backend's in-flight count released, however the stream ends:
on a normal end, a broken backend, or a client that went away (a shielded cleanup, so that the
backend sees the disconnect and aborts the request).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import httpx
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvserve.errors import EngineDeadError
from kvserve.server.errors import error_body

log = logging.getLogger("kvserve.router")

MAX_EVENT_BYTES = 1 << 20  # an event longer than this is passed through without looking for usage in it


class BackendFailedError(EngineDeadError):
    """The backend serving a request failed (HTTP 503; mid-stream, an error event)."""

    code = "backend_failed"


def error_event(exc: BaseException) -> bytes:
    """One SSE event carrying OpenAI's error body for ``exc``."""
    return f"data: {error_body(exc)[1].model_dump_json()}\n\n".encode()


def cached_tokens_of(payload: bytes) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of a JSON response or event (0 when absent)."""
    try:
        usage = json.loads(payload).get("usage") or {}
        return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    except (ValueError, AttributeError, TypeError):
        return 0


class StreamWatch:
    """Looks at the bytes of a stream going by: the events' usage, and where the last one ended."""

    def __init__(self) -> None:
        self._line = b""
        self._last2 = b""
        self.cached_tokens = 0

    def feed(self, chunk: bytes) -> None:
        if not chunk:
            return
        self._last2 = (self._last2 + chunk)[-2:]
        *lines, self._line = (self._line + chunk).split(b"\n")
        if len(self._line) > MAX_EVENT_BYTES:
            self._line = b""
        for line in lines:
            if line.startswith(b"data: {") and b'"cached_tokens"' in line:
                self.cached_tokens += cached_tokens_of(line[6:])

    @property
    def between_events(self) -> bool:
        """True when nothing went out yet or the last event is complete."""
        return self._last2 in (b"", b"\n\n")


class Relay:
    """One backend stream, from its first chunk on; ``close`` once, whatever happens."""

    def __init__(self, backend_url: str, response: httpx.Response, chunks: AsyncIterator[bytes], first: bytes,
                 on_close: Callable[[StreamWatch, bool], Awaitable[None] | None]):
        self.backend_url = backend_url
        self.response = response
        self.chunks = chunks
        self.first = first
        self.watch = StreamWatch()
        self.broken = False
        self._on_close = on_close
        self._closed = False

    async def body(self) -> AsyncIterator[bytes]:
        self.watch.feed(self.first)
        yield self.first
        try:
            async for chunk in self.chunks:
                self.watch.feed(chunk)
                yield chunk
        except httpx.HTTPError as e:
            self.broken = True
            log.warning("backend %s broke a stream: %s: %s", self.backend_url, type(e).__name__, e)
            end = b"" if self.watch.between_events else b"\n\n"
            yield end + error_event(BackendFailedError(
                f"the backend serving this request failed mid-stream ({type(e).__name__}); the answer is incomplete"))
            yield b"data: [DONE]\n\n"

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self.response.aclose()
            result = self._on_close(self.watch, self.broken)
            if result is not None:
                await result


class RelayResponse(StreamingResponse):
    """A streaming response over a ``Relay`` that closes it however the response ends."""

    def __init__(self, relay: Relay, status_code: int, headers: dict[str, str]):
        super().__init__(relay.body(), status_code=status_code, headers=headers)
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.close()
