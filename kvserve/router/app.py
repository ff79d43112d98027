"""The router's FastAPI app (``create_router_app``): the proxied OpenAI routes, /health, /metrics, /admin.

- ``POST /v1/completions``, ``POST /v1/chat/completions``: tokenized, routed by the policy, proxied (with
  ``--prefill``/``--decode``: prefill leg, then decode leg, ``kvserve.router.disagg``).
- Every other ``/v1/...`` route, ``/tokenize``, ``/detokenize``, ``/version``: proxied to the least
  loaded backend (the backends answer what they serve, and their 404s for what they do not).
- ``POST /update_weights_from_disk``, ``/sleep``, ``/wake_up``, ``/v1/load_lora_adapter``,
  ``/v1/unload_lora_adapter``: sent to every replica, each one's answer reported (``kvserve.router.fanout``).
- ``GET /health``: 200 while a backend is up, else 503. ``GET /metrics``: the router's Prometheus metrics.
- ``GET /admin/backends`` (each backend's state), ``POST /admin/backends`` ``{"url"}`` (add one),
  ``DELETE /admin/backends`` ``{"url"}`` or ``?url=`` (remove one); with ``--admin-key``, they and the
  fanned-out routes need it.

Errors are OpenAI's error body (``kvserve.server.errors``); the body size limit is the server's guard.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

import kvserve
from kvserve.errors import AuthenticationError, InvalidArgumentError, NotFoundError
from kvserve.router.config import RouterConfig
from kvserve.router.fanout import FANNED_OUT, fan_out, replica_headers
from kvserve.router.prompt import PromptTokenizer
from kvserve.router.proxy import NoBackendError
from kvserve.router.state import RouterState
from kvserve.server.errors import HANDLED_EXCEPTIONS, ClientDisconnected, handle_error
from kvserve.server.middleware import GuardMiddleware
from kvserve.server.streaming import unless_disconnected


async def _state(request: Request) -> RouterState:  # async: FastAPI runs a plain def in a thread pool
    return request.app.state.router


State = Annotated[RouterState, Depends(_state)]


async def _admin(request: Request) -> None:
    key = request.app.state.router.config.admin_key
    if key is None:
        return
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise AuthenticationError("missing or wrong admin key")


Admin = Annotated[None, Depends(_admin)]


async def _proxied(request: Request, state: RouterState, kind: str | None) -> Response:
    assert state.proxy is not None, "the router's lifespan did not start"
    route = await state.route(request, kind)
    try:
        # a client that goes away before the answer starts cancels the backend request with it
        forward = state.split.forward if state.split is not None and kind else state.proxy.forward
        return await unless_disconnected(request, forward(route))
    except ClientDisconnected:
        return Response(status_code=499)


async def _url_of(request: Request) -> str:
    url = request.query_params.get("url")
    if url is None and await request.body():
        try:
            body = await request.json()
        except ValueError:
            raise InvalidArgumentError("the body must be JSON: {\"url\": \"http://host:port\"}") from None
        url = body.get("url") if isinstance(body, dict) else None
    if not isinstance(url, str):
        raise InvalidArgumentError('give the backend as {"url": "http://host:port"}', param="url")
    return url


def create_router_app(config: RouterConfig, prompts: PromptTokenizer | None) -> FastAPI:
    """The router's app over ``config``'s backends; ``prompts`` tokenizes (None: route on load alone)."""
    state = RouterState(config, prompts)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.close()

    app = FastAPI(title="kvserve router", version=kvserve.__version__, lifespan=lifespan)
    app.state.router = state
    app.add_middleware(GuardMiddleware, api_key=None, max_bytes=config.max_request_bytes)
    for exc_class in HANDLED_EXCEPTIONS:
        app.add_exception_handler(exc_class, handle_error)

    @app.post("/v1/completions")
    async def completions(request: Request, state: State) -> Response:
        return await _proxied(request, state, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, state: State) -> Response:
        return await _proxied(request, state, "chat")

    async def fanned_out(request: Request, state: State, _: Admin) -> Response:
        assert state.proxy is not None, "the router's lifespan did not start"
        route = await state.route(request, None)
        c = state.config
        return await fan_out(state.proxy.client, state.replica_urls(), route,
                             replica_headers(route, c.admin_key is not None, c.backend_api_key))

    for path in FANNED_OUT:  # before the /v1 catch-all, which would send them to one replica
        app.add_api_route(path, fanned_out, methods=["POST"])

    @app.api_route("/v1/{rest:path}", methods=["GET", "POST", "DELETE"])
    async def other_v1(rest: str, request: Request, state: State) -> Response:
        return await _proxied(request, state, None)

    @app.api_route("/tokenize", methods=["POST"])
    @app.api_route("/detokenize", methods=["POST"])
    @app.api_route("/version", methods=["GET"])
    async def other(request: Request, state: State) -> Response:
        return await _proxied(request, state, None)

    @app.get("/health")
    async def health(state: State) -> dict[str, Any]:
        up = state.backends.healthy()
        if not up:
            raise NoBackendError(f"none of the {len(state.backends)} backends is up")
        return {"status": "ok", "backends": len(state.backends), "healthy": len(up)}

    @app.get("/metrics")
    async def metrics(state: State) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/backends")
    async def list_backends(state: State, _: Admin) -> dict[str, Any]:
        return {"policy": state.policy.name, "backends": [b.describe() for b in state.backends]}

    @app.post("/admin/backends")
    async def add_backend(request: Request, state: State, _: Admin) -> dict[str, Any]:
        return (await state.add_backend(await _url_of(request))).describe()

    @app.delete("/admin/backends")
    async def remove_backend(request: Request, state: State, _: Admin) -> dict[str, Any]:
        url = await _url_of(request)
        backend = await state.remove_backend(url)
        if backend is None:
            raise NotFoundError(f"there is no backend {url}", param="url")
        return {"removed": backend.url}

    return app
