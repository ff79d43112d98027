"""Running a forwarded request on an ASGI app in-process (``run_on_app``): streamed as written; an early close is a disconnect.

No Ray needed: this is how a Ray Serve replica runs each request on kvserve's app.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from kvserve.ray_serve.call import ReplicaCall, ResponseStart, run_on_app


def make_app(events: list[str], release: asyncio.Event) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"body": await request.json(), "query": request.url.query, "auth": request.headers.get("authorization")}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def chunks():
            try:
                yield b"data: 1\n\n"
                await release.wait()  # the second chunk comes only when the test says so
                yield b"data: 2\n\n"
            finally:
                events.append("closed")  # kvserve aborts its engine requests here

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


def test_a_request_runs_on_the_app_and_streams_back_as_written():
    async def go():
        events: list[str] = []
        release = asyncio.Event()
        app = make_app(events, release)
        call = ReplicaCall("POST", "/echo", "a=1", [(b"authorization", b"Bearer k"), (b"content-type", b"application/json")],
                           json.dumps({"x": 1}).encode())
        items = [item async for item in run_on_app(app, call)]
        assert isinstance(items[0], ResponseStart) and items[0].status == 200
        assert json.loads(b"".join(items[1:])) == {"body": {"x": 1}, "query": "a=1", "auth": "Bearer k"}

        answer = run_on_app(app, ReplicaCall("GET", "/stream", "", [], b""))
        start = await answer.__anext__()
        assert (b"content-type", b"text/event-stream; charset=utf-8") in start.headers
        assert await answer.__anext__() == b"data: 1\n\n"  # before the app wrote the rest: streamed
        release.set()
        assert await answer.__anext__() == b"data: 2\n\n"
        assert [x async for x in answer] == [] and events == ["closed"]

        missing = [item async for item in run_on_app(app, ReplicaCall("GET", "/nope", "", [], b""))]
        assert missing[0].status == 404
    asyncio.run(go())


def test_closing_the_answer_early_is_a_client_disconnect_for_the_app():
    async def go():
        events: list[str] = []
        inner = make_app(events, asyncio.Event())  # never released: the app waits for its second chunk

        async def app(scope, receive, send):  # records what the app hears from its client
            async def heard():
                message = await receive()
                events.append(message["type"])
                return message
            await inner(scope, heard, send)

        answer = run_on_app(app, ReplicaCall("GET", "/stream", "", [], b""))
        assert isinstance(await answer.__anext__(), ResponseStart)
        assert await answer.__anext__() == b"data: 1\n\n"
        await answer.aclose()  # the client went away
        assert events[-2:] == ["http.disconnect", "closed"]  # the app heard it and ended its stream
    asyncio.run(go())
