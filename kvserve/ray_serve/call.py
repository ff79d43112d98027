"""One HTTP request handed from the ingress to a replica (``ReplicaCall``), and running it on an ASGI app.

The ingress forwards a request whole (method, path, query, headers, body) plus what the request
router needs to choose a replica (the prompts' token ids, a session); the replica runs it on
kvserve's own FastAPI app, in-process, and streams the answer back as a ``ResponseStart`` then the
body's chunks as the app writes them (``run_on_app``). No Ray here: both ends are plain asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

APP_EXIT_GRACE_S = 5.0  # how long the app may take to clean up after its client went away


@dataclass
class ReplicaCall:
    """An HTTP request for a replica, and what the request router routes it by."""

    method: str
    path: str
    query: str
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prompts: list[list[int]] | None = None  # token ids of each prompt (generation requests the ingress tokenized)
    session: str | None = None  # X-Session-Id or the body's ``user`` (the ``session`` policy)
    model: str | None = None  # the body's model: a LoRA adapter goes to a replica that has it loaded


@dataclass
class ResponseStart:
    """The first thing a replica yields: the answer's status and headers (its body chunks follow)."""

    status: int
    headers: list[tuple[bytes, bytes]]


async def run_on_app(app: Any, call: ReplicaCall) -> AsyncIterator[ResponseStart | bytes]:
    """Run ``call`` on the ASGI ``app``: a ``ResponseStart``, then the body as the app sends it.

    Closing the iterator early (the client went away) tells the app the client disconnected, so
    that kvserve aborts the request's engine requests, and gives it a moment to do so.
    """
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": call.method, "scheme": "http", "path": call.path, "raw_path": call.path.encode(),
             "query_string": call.query.encode("latin-1"), "root_path": "", "headers": list(call.headers),
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    sent: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> dict[str, Any]:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.put_nowait(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            sent.put_nowait(None)

    task = asyncio.create_task(run())
    started = False
    try:
        while True:
            message = await sent.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                started = True
                yield ResponseStart(message["status"], [(bytes(k), bytes(v)) for k, v in message.get("headers", ())])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        if not started:  # the app failed before it answered
            await asyncio.wait({task}, timeout=APP_EXIT_GRACE_S)
            raise (task.exception() if task.done() else None) or RuntimeError("the app ended without an answer")
    finally:
        gone.set()
        done, _ = await asyncio.wait({task}, timeout=APP_EXIT_GRACE_S)
        if not done:
            task.cancel()
        with contextlib.suppress(BaseException):
            await task  # (and its exception, if any, is retrieved)
