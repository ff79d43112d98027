"""Counting the server's HTTP responses by route and status (``kvserve_http_requests_total``).

vLLM's metrics count only requests that reached the engine (``request_success_total``, by finish
reason); an operator also wants the ones refused before it: 400s, 401s, 413s, 429s. This ASGI
middleware sits outside every other, so it sees those too.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HttpMetricsMiddleware:
    """Counts each HTTP response once, labelled by its route (a path the app serves, else "other",
    so that scanners cannot grow the label set) and status code."""

    def __init__(self, app: ASGIApp, counter: Counter, routes: Iterable[str]):
        self.app = app
        self.counter = counter
        self.routes = frozenset(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "other"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counter.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)
