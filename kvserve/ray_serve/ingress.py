"""The OpenAI endpoint on Ray Serve (``KVServeIngress``): a FastAPI ingress that hands each request to a replica.

Every route kvserve serves is forwarded whole to one ``KVServeReplica`` through a deployment
handle, and its answer streamed back as the replica writes it (server-sent events included); the
replicas' admin routes (sleep, wake, weight updates, LoRA load/unload: ``kvserve.router.fanout``) go to
every replica instead (``DeploymentHandle.broadcast``), answered with each one's result as
``kvserve router`` answers them. A
completion or chat request is tokenized here first (``kvserve.router.prompt``, as ``kvserve
router`` does), so that the request router can match its prompt against each replica's cache. A
replica that fails before its first byte is replaced by another (up to ``MAX_ATTEMPTS``); a stream
that breaks later ends with an error event and ``data: [DONE]``. Errors have OpenAI's shape.
"""

# (no `from __future__ import annotations`: Ray Serve's ingress rebuilds the routes' signatures, and
# FastAPI must see `Request` itself, not its name, to inject the request)
import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle

from kvserve.errors import RequestTooLargeError
from kvserve.ray_serve.call import ReplicaCall, ResponseStart
from kvserve.router.fanout import FANNED_OUT, summarize
from kvserve.router.prompt import PromptTokenizer, body_model
from kvserve.router.proxy import RESPONSE_DROPPED
from kvserve.router.relay import BackendFailedError, StreamWatch, error_event
from kvserve.router.state import SESSION_HEADER
from kvserve.server.errors import HANDLED_EXCEPTIONS, error_response, handle_error

log = logging.getLogger("kvserve.ray_serve")

MAX_ATTEMPTS = 3  # replicas tried for one request that fail before answering
GENERATION_ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}

app = FastAPI(title="kvserve on Ray Serve")
for _exc_class in HANDLED_EXCEPTIONS:  # the ingress's own errors in OpenAI's shape too
    app.add_exception_handler(_exc_class, handle_error)


# (helpers before the class: serve.ingress captures the module's names as they are when it runs)
async def relay(answer: Any, sse: bool) -> AsyncIterator[bytes]:
    """A replica's body chunks; if the replica breaks mid-stream, an error event (``sse``) or the end."""
    watch = StreamWatch()
    finished = False
    try:
        async for chunk in answer:
            watch.feed(chunk)
            yield chunk
        finished = True
    except Exception as e:  # noqa: BLE001 - the replica died or failed mid-answer
        finished = True
        log.warning("a replica broke a stream: %s: %s", type(e).__name__, e)
        if sse:
            yield (b"" if watch.between_events else b"\n\n") + error_event(BackendFailedError(
                "the replica serving this request failed mid-stream; the answer is incomplete"))
            yield b"data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away: the replica stops, and kvserve aborts its engine requests
            answer.cancel()


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


@serve.ingress(app)
class KVServeIngress:
    def __init__(self, replicas: DeploymentHandle, model: str | None = None, tool_call_parser: str = "auto",
                 max_request_bytes: int = 8 << 20):
        self.replicas = replicas.options(stream=True)
        self.every_replica = replicas  # broadcast: the admin routes, one whole answer from each replica
        self.prompts = PromptTokenizer.load(model, tool_call_parser)
        self.max_request_bytes = max_request_bytes

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(self, path: str, request: Request) -> Response:
        body = await request.body()
        if len(body) > self.max_request_bytes:
            return error_response(RequestTooLargeError(f"the request body is over the limit of "
                                                       f"{self.max_request_bytes} bytes"))
        call = await self.call_of(request, body)
        if request.method == "POST" and request.url.path in FANNED_OUT:
            return await self.fan_out(call)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            answer = self.replicas.handle.remote(call)
            try:
                start = await answer.__anext__()
            except RayActorError as e:  # the replica died: nothing reached the client yet, so try another
                log.warning("a replica failed before answering (attempt %d of %d): %s", attempt, MAX_ATTEMPTS, e)
                continue
            except Exception as e:  # noqa: BLE001 - the replica's own failure: a 500 in OpenAI's shape
                return error_response(e)
            assert isinstance(start, ResponseStart)
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers
                       if k.decode("latin-1").lower() not in RESPONSE_DROPPED}
            sse = headers.get("content-type", "").startswith("text/event-stream")
            return StreamingResponse(relay(answer, sse), status_code=start.status, headers=headers)
        return error_response(BackendFailedError(f"{MAX_ATTEMPTS} replicas failed before answering"))

    async def fan_out(self, call: ReplicaCall) -> Response:
        """``call`` run on every replica live now; shielded: a client that goes away leaves none half-way."""
        answers = await asyncio.shield(self.every_replica.broadcast("admin", call).results_async(
            return_exceptions=True))
        return summarize([a if isinstance(a, dict) else {"replica": "?", "status_code": None, "body": None,
                                                          "error": f"{type(a).__name__}: {a}"} for a in answers])

    async def call_of(self, request: Request, body: bytes) -> ReplicaCall:
        """The request as a replica gets it, with its prompts' token ids when it is a generation request."""
        kind = GENERATION_ROUTES.get(request.url.path) if request.method == "POST" else None
        payload = _json(body) if kind else None
        prompts = await self.prompts.prompts(kind, payload) if kind and isinstance(payload, dict) else None
        session = request.headers.get(SESSION_HEADER)
        if session is None and isinstance(payload, dict) and isinstance(payload.get("user"), str):
            session = payload["user"]
        return ReplicaCall(request.method, request.url.path, request.url.query, list(request.headers.raw), body,
                           prompts=prompts, session=session, model=body_model(payload))
