"""Forwarding a request to a backend (``Proxy``): choose one, send, retry elsewhere before the first byte.

For each attempt the policy chooses among the healthy backends not tried yet, given how much of the
prompt each one's cache holds (``PromptHashes`` against its mirrored set and the blocks its requests
in flight are computing), the prefill work queued there, and its load. The chosen backend remembers
the request's blocks and queued work (``Backend.predict``) until its first byte (work done) and its
end (blocks cached or never). The request goes out as it came (method, path, query, body, headers
such as ``Authorization``; not hop-by-hop ones). A backend that cannot be reached, breaks before
answering, or answers 429 / 502 / 503 / 504 is given up and the next one tried, up to
``max_attempts``; when none is left the last such answer (or a 503) goes to the client. A stream is
committed once its first chunk has arrived: after that the bytes pass through unchanged
(``relay.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass

import httpx
from fastapi.responses import Response

from kvserve.errors import EngineDeadError
from kvserve.router.backends import Backend, BackendSet, Prediction
from kvserve.router.metrics import RouterMetrics
from kvserve.router.monitor import Monitor
from kvserve.router.policy import Candidate, Policy, holding_adapter
from kvserve.router.prefix import PromptHashes
from kvserve.router.relay import Relay, RelayResponse, StreamWatch, cached_tokens_of

log = logging.getLogger("kvserve.router")

# Not forwarded either way: they describe one connection, not the request (RFC 9110 7.6.1), or are
# the router's to set (host, the body's length, its encoding: the router asks backends for identity).
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding"})
RESPONSE_DROPPED = HOP_BY_HOP | {"date", "server"}  # the router's own server adds these
RETRY_STATUSES = frozenset({429, 502, 503, 504})


class NoBackendError(EngineDeadError):
    """No backend is up to take the request (HTTP 503)."""

    code = "no_backend"


@dataclass
class Route:
    """One request, as the proxy forwards it."""

    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes
    stream: bool = False
    prompts: PromptHashes | None = None  # None: not a generation request, or not tokenized
    session: str | None = None
    model: str | None = None  # the body's model (a LoRA adapter goes where it is loaded)


@dataclass
class _Retry:
    """An attempt that failed before anything reached the client; ``response`` is its answer, if any."""

    response: Response | None = None


def forwarded_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """The end-to-end headers of a client's request (``Authorization`` among them), as sent on to a backend."""
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw
               if k.decode("latin-1").lower() not in HOP_BY_HOP]
    headers.append(("accept-encoding", "identity"))  # bytes pass through as the backend wrote them
    return headers


def _response_headers(resp: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in RESPONSE_DROPPED}


class Proxy:
    def __init__(self, backends: BackendSet, policy: Policy, monitor: Monitor, metrics: RouterMetrics,
                 client: httpx.AsyncClient, max_attempts: int = 3):
        self.backends = backends
        self.policy = policy
        self.monitor = monitor
        self.metrics = metrics
        self.client = client
        self.max_attempts = max_attempts

    def choose(self, route: Route, exclude: Collection[str] = ()) -> tuple[Backend, int] | None:
        """The backend for ``route`` among the healthy ones not in ``exclude``, and the prompt tokens it
        is predicted to have cached; None when there is none."""
        live = [b for b in self.backends.healthy() if b.url not in exclude]
        if not live:
            return None
        live = holding_adapter(live, route.model, lambda b: b.adapters)
        prompts = route.prompts
        candidates = {b.url: Candidate(b.url, prompts.cached_tokens(b.scheme, b.cache_view) if prompts else 0, b.load,
                                       b.queued_tokens) for b in live}
        name = self.policy.choose(list(candidates.values()), route.session)
        backend = next(b for b in live if b.url == name)
        return backend, candidates[name].cached_tokens

    async def attempt(self, backend: Backend, route: Route) -> Response | None:
        """One try on ``backend``; None when it failed before anything reached the client."""
        outcome = await self._attempt(backend, route, 0)
        if isinstance(outcome, _Retry):
            self.metrics.retries.labels(backend.url).inc()
            return None
        return outcome

    async def forward(self, route: Route, exclude: Collection[str] = ()) -> Response:
        """Send ``route`` to the policy's choice, then to others before the first byte (none in ``exclude``)."""
        tried: set[str] = set(exclude)
        fallback: Response | None = None
        while len(tried) < self.max_attempts + len(exclude):
            choice = self.choose(route, tried)
            if choice is None:
                break
            backend, predicted = choice
            tried.add(backend.url)
            outcome = await self._attempt(backend, route, predicted)
            if not isinstance(outcome, _Retry):
                return outcome
            self.metrics.retries.labels(backend.url).inc()
            fallback = outcome.response or fallback
        if fallback is not None:
            return fallback
        if tried:
            raise NoBackendError(f"no backend could take the request (tried {len(tried)})")
        raise NoBackendError("no backend is up to take the request")

    async def _attempt(self, backend: Backend, route: Route, predicted: int) -> Response | _Retry:
        request = self.client.build_request(route.method, backend.url + route.path, params=route.query or None,
                                            headers=route.headers, content=route.body)
        backend.in_flight += 1
        prediction = self._predict(backend, route, predicted)
        release = True  # this attempt's in-flight count is released here, unless a relay took it over
        try:
            try:
                resp = await self.client.send(request, stream=True)
            except httpx.ConnectError as e:
                self.monitor.connect_failed(backend, e)
                return _Retry()
            except httpx.HTTPError as e:
                self.monitor.check_failed(backend, e)
                return _Retry()
            try:
                if route.stream and resp.status_code == 200:
                    chunks = resp.aiter_raw()
                    first = await anext(chunks, b"")
                    backend.prefilled(prediction)
                    relay = Relay(backend.url, resp, chunks, first,
                                  lambda watch, broken: self._stream_done(backend, route, predicted, prediction,
                                                                          watch, broken))
                    release = False
                    return RelayResponse(relay, resp.status_code, _response_headers(resp))
                content = await resp.aread()
            except httpx.HTTPError as e:
                self.monitor.check_failed(backend, e)
                return _Retry()
            finally:
                if release:
                    await resp.aclose()
            answer = Response(content, status_code=resp.status_code, headers=_response_headers(resp))
            if resp.status_code in RETRY_STATUSES:
                if resp.status_code == 503:  # its engine is gone (or it is stopping)
                    self.monitor.check_failed(backend, "answered 503")
                log.info("backend %s answered %d: trying another", backend.url, resp.status_code)
                return _Retry(answer)
            self._done(backend, route, predicted, resp.status_code,
                       cached_tokens_of(content) if resp.status_code == 200 and b'"cached_tokens"' in content else 0)
            return answer
        finally:
            if release:
                backend.in_flight -= 1
                backend.finished(prediction)

    @staticmethod
    def _predict(backend: Backend, route: Route, predicted: int) -> Prediction:
        """What the request adds to the router's view of ``backend`` while it runs there."""
        prompts = route.prompts
        if prompts is None or backend.scheme is None:
            return backend.predict([], 0)
        blocks = [h for hashes in prompts.hashes(backend.scheme) for h in hashes]
        return backend.predict(blocks, max(0, prompts.num_tokens - predicted))

    def _stream_done(self, backend: Backend, route: Route, predicted: int, prediction: Prediction,
                     watch: StreamWatch, broken: bool) -> None:
        backend.in_flight -= 1
        backend.finished(prediction)
        if broken:
            self.metrics.stream_errors.labels(backend.url).inc()
        self._done(backend, route, predicted, 200, watch.cached_tokens)

    def _done(self, backend: Backend, route: Route, predicted: int, status: int, reported_cached: int) -> None:
        url = backend.url
        self.metrics.requests.labels(url, str(status)).inc()
        if status == 200 and route.prompts is not None:
            self.metrics.routed(url, route.prompts.num_tokens, predicted)
            self.metrics.reported_cached.labels(url).inc(reported_cached)
