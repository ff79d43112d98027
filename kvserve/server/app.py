"""The FastAPI app: ``create_app``, which wires the guard middleware, the
error handlers and the routers over one ``ServerState``.

A request's path: the guard middleware (API key, body size) → FastAPI parses the body into a
``kvserve.server.protocol`` model → the route (``kvserve.server.routes``) tokenizes, validates, and
adds one engine request per prompt and choice through the engine client → outputs come back as
RequestOutputs and are rendered (``kvserve.server.render``) as one JSON response or as server-sent
events (``kvserve.server.streaming``). Every error a client can cause ends in
``kvserve.server.errors.error_response``, the one place that picks an HTTP status and writes
OpenAI's error body.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

import kvserve
from kvserve.config import ServerConfig
from kvserve.server.engine_client import EngineClient
from kvserve.server.errors import HANDLED_EXCEPTIONS, handle_error
from kvserve.server.http_metrics import HttpMetricsMiddleware
from kvserve.server.middleware import GuardMiddleware
from kvserve.server.routes import admin, kv, lora, model, openai, tokenize, ui
from kvserve.server.state import ServerState

def create_app(client: EngineClient, config: ServerConfig | None = None, *, own_client: bool = True) -> FastAPI:
    """The FastAPI app over a started engine client. With ``own_client``, the app's shutdown stops it."""
    config = config or ServerConfig()
    state = ServerState(client, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.attach()
        try:
            yield
        finally:
            state.close()
            if own_client:
                client.shutdown()

    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan)
    app.state.server = state  # what routes reach through kvserve.server.state.get_state
    app.add_middleware(GuardMiddleware, api_key=config.api_key, max_bytes=config.max_request_bytes)
    for exc_class in HANDLED_EXCEPTIONS:
        app.add_exception_handler(exc_class, handle_error)
    # ui: the web page (docs/ui.md); lora: the runtime adapter routes (docs/lora.md); model: sleep, wake, new weights
    routers = (admin.router, model.router, openai.router, lora.router, tokenize.router, kv.router, ui.router)
    for router in routers:
        app.include_router(router)
    # added last, so outermost: it counts the guard's refusals too
    app.add_middleware(HttpMetricsMiddleware, counter=state.metrics.http_requests,
                       routes=[r.path for router in routers for r in router.routes if "{" not in r.path])
    return app
