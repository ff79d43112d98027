"""How an answer goes out: one JSON response, or server-sent events, and what a disconnect does.

``respond`` drives both: it merges the request's engine streams, and hands their outputs to a
``Renderer`` (``kvserve.server.render``) that turns them into OpenAI's response or its events.
A client that goes away (before the answer, or mid-stream) gets its engine requests aborted at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from kvserve.text.output import RequestOutput
from kvserve.server.request_stream import RequestStream
from kvserve.errors import KVServeError
from kvserve.server.errors import ClientDisconnected, error_body

T = TypeVar("T")
Event = tuple[int, RequestOutput]  # a choice's index (prompt * n + i) and its latest output


class Renderer(Protocol):
    """Turns one HTTP request's outputs into OpenAI's wire format (see kvserve.server.render)."""

    def response(self, outs: dict[int, RequestOutput]) -> BaseModel:
        """The whole answer, from each choice's final output."""
        ...

    def events(self, events: AsyncIterator[Event], first: Event) -> AsyncIterator[str]:
        """The SSE events of a stream, ``first`` then the rest of ``events`` (no [DONE])."""
        ...


# Characters JSON may leave raw that line-splitting clients (str.splitlines, httpx's aiter_lines)
# take for line ends, cutting an event in two: escape them. A sampled token can be one of these.
_LINE_BREAKERS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(model: Any) -> str:
    """One server-sent event carrying ``model`` as JSON."""
    return f"data: {model.model_dump_json().translate(_LINE_BREAKERS)}\n\n"


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator, so aborts run at once on a disconnect."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``; if the client goes away first, cancel it and raise ClientDisconnected."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise ClientDisconnected()
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)


async def merge_streams(streams: list[RequestStream]) -> AsyncGenerator[Event, None]:
    """Outputs of several engine requests (n choices, several prompts) as they come, tagged by index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


async def respond(request: Request, streams: list[RequestStream], stream: bool, renderer: Renderer) -> Response:
    """The answer to a request whose engine requests are ``streams``: JSON, or SSE if ``stream``."""
    events = merge_streams(streams)
    handed_over = False  # to the streaming response, which then owns the cleanup
    try:
        if not stream:
            async def collect() -> dict[int, RequestOutput]:
                finals: dict[int, RequestOutput] = {}
                async for i, out in events:
                    finals[i] = out
                return finals

            return JSONResponse(renderer.response(await unless_disconnected(request, collect())).model_dump())
        # Wait for the first output before sending headers: an error the engine reports for
        # the request (or a dead engine) still gets its proper status this way.
        first = await unless_disconnected(request, anext(events))
        handed_over = True
        return SSEResponse(_sse_body(streams, events, first, renderer), media_type="text/event-stream")
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the requests are aborted below
    finally:
        if not handed_over:
            await events.aclose()
            for s in streams:
                s.abort()


async def _sse_body(streams: list[RequestStream], events: AsyncGenerator[Event, None], first: Event,
                    renderer: Renderer) -> AsyncIterator[str]:
    try:
        async for chunk in renderer.events(events, first):
            yield chunk
    except KVServeError as e:  # e.g. the engine died mid-stream: say so in the stream
        yield sse_event(error_body(e)[1])
    finally:
        # runs on normal ends, errors and disconnects alike (see SSEResponse)
        await events.aclose()
        for s in streams:
            s.abort()
    yield "data: [DONE]\n\n"
