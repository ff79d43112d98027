"""The router's state (``RouterState``): its backends, policy, monitor, proxy, tokenizer and metrics.

Built before the event loop runs; ``start`` (in the app's lifespan, on the loop) opens the HTTP
clients and starts watching every backend, ``close`` stops it all. Backends added or removed at run
time (``/admin/backends``) start or stop being watched at once.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from fastapi import Request

from kvserve.router.backends import Backend, BackendSet
from kvserve.router.config import RouterConfig
from kvserve.router.disagg import SplitProxy
from kvserve.router.metrics import RouterMetrics
from kvserve.router.monitor import Monitor, MonitorConfig
from kvserve.router.policy import make_policy
from kvserve.router.prefix import PromptHashes
from kvserve.router.prompt import PromptTokenizer, body_model
from kvserve.router.proxy import Proxy, Route, forwarded_headers

SESSION_HEADER = "x-session-id"


class RouterState:
    def __init__(self, config: RouterConfig, prompts: PromptTokenizer | None):
        self.config = config
        self.prompts = prompts
        # with a split, ``backends`` are the decode replicas (and /health, /metrics, other routes use them)
        self.backends = BackendSet(config.decode + config.backends)
        self.prefill_backends = BackendSet(config.prefill) if config.prefill else None
        self.policy = make_policy(config.policy, config.max_load_imbalance)
        self.metrics = RouterMetrics(lambda: self.backends)
        self._clients: list[httpx.AsyncClient] = []
        self.monitor: Monitor | None = None
        self.proxy: Proxy | None = None
        self.split: SplitProxy | None = None

    async def start(self) -> None:
        c = self.config
        # trust_env=False: backends are reached directly, never through a proxy from the environment
        http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=c.connect_timeout_s), trust_env=False,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        key = c.backend_api_key
        watch = httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_connections=None),
                                  headers={"Authorization": f"Bearer {key}"} if key else None)
        self._clients = [http, watch]
        self.monitor = Monitor(watch, MonitorConfig(health_interval_s=c.health_interval_s, fail_after=c.fail_after,
                                                    events_wait_s=c.events_wait_s))
        self.proxy = Proxy(self.backends, self.policy, self.monitor, self.metrics, http, c.max_attempts)
        for b in self.backends:
            self.monitor.watch(b)
        if self.prefill_backends is not None:  # prefill by prefix affinity, decode by load
            prefill = Proxy(self.prefill_backends, self.policy, self.monitor, self.metrics, http, c.max_attempts)
            decode = Proxy(self.backends, make_policy("least-load", c.max_load_imbalance), self.monitor, self.metrics,
                           http, c.max_attempts)
            self.split = SplitProxy(prefill, decode, watch)  # asks GET /kv/transfer with the replicas' key
            for b in self.prefill_backends:
                self.monitor.watch(b)

    async def close(self) -> None:
        if self.monitor is not None:
            await self.monitor.close()
        for client in self._clients:
            await client.aclose()
        if self.prompts is not None:
            self.prompts.close()

    # -- backends at run time -----------------------------------------------------------------
    async def add_backend(self, url: str) -> Backend:
        backend, new = self.backends.add(url)
        if new and self.monitor is not None:
            await self.monitor.check(backend)  # so the answer says whether it is up
            self.monitor.watch(backend)
        return backend

    async def remove_backend(self, url: str) -> Backend | None:
        backend = self.backends.remove(url)
        if backend is not None:
            if self.monitor is not None:
                await self.monitor.unwatch(backend)
            self.policy.forget(backend.url)
        return backend

    def replica_urls(self) -> list[str]:
        """Every replica the router knows, healthy or not, prefill ones included (where admin routes go)."""
        return [b.url for b in self.backends] + [b.url for b in self.prefill_backends or ()]

    # -- requests -------------------------------------------------------------------------------
    async def route(self, request: Request, kind: str | None) -> Route:
        """The request as the proxy forwards it; ``kind`` (completions, chat) asks for its prompt's tokens."""
        body = await request.body()
        payload = _json(body) if kind else None
        prompts = None
        if kind and self.prompts is not None and payload is not None:
            ids = await self.prompts.prompts(kind, payload)
            prompts = PromptHashes(ids) if ids else None
        session = request.headers.get(SESSION_HEADER)
        if session is None and isinstance(payload, dict) and isinstance(payload.get("user"), str):
            session = payload["user"]
        return Route(request.method, request.url.path, request.url.query, forwarded_headers(request.headers.raw),
                     body, stream=isinstance(payload, dict) and payload.get("stream") is True, prompts=prompts,
                     session=session, model=body_model(payload))


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None

