"""The router's Prometheus metrics (``GET /metrics``), per backend.

Counters: requests routed (by backend and HTTP status), retries (by the backend that failed), the
prompt tokens the router predicted to be cached where it sent them, the cached tokens the backend
then reported (``usage.prompt_tokens_details.cached_tokens``; streams report usage only with
``stream_options.include_usage``), and the prompt tokens routed. Gauges, read at scrape time: each
backend's health, requests in flight, reported load and mirrored cache size. The router has its
own registry, so tests can build several routers in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.router.backends import Backend


class _BackendCollector(Collector):
    def __init__(self, backends: Callable[[], Iterable[Backend]]):
        self.backends = backends

    def collect(self) -> Iterator[Metric]:
        gauges = [
            ("kvserve_router_backend_healthy", "1 while the backend is routed to, 0 while it is out.",
             lambda b: float(b.healthy)),
            ("kvserve_router_backend_in_flight", "This router's requests in flight on the backend.",
             lambda b: b.in_flight),
            ("kvserve_router_backend_running", "Requests the backend reported running.", lambda b: b.running),
            ("kvserve_router_backend_waiting", "Requests the backend reported waiting.", lambda b: b.waiting),
            ("kvserve_router_backend_kv_cache_usage_perc", "KV cache usage the backend reported (1 = full).",
             lambda b: b.kv_usage),
            ("kvserve_router_backend_cached_blocks", "Blocks in the router's mirror of the backend's prefix cache.",
             lambda b: len(b.cached)),
        ]
        backends = list(self.backends())
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=["backend"])
            for b in backends:
                g.add_metric([b.url], value(b))
            yield g


class RouterMetrics:
    def __init__(self, backends: Callable[[], Iterable[Backend]]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvserve_router_requests", "Requests answered, by backend and HTTP status.",
                                ["backend", "status"], registry=r)
        self.retries = Counter("kvserve_router_retries", "Attempts that failed before any byte reached the client, "
                               "by the backend that failed (the request then went to the next one, if any).",
                               ["backend"], registry=r)
        self.stream_errors = Counter("kvserve_router_stream_errors", "Streams a backend broke mid-way (the client "
                                     "got an error event).", ["backend"], registry=r)
        self.prompt_tokens = Counter("kvserve_router_prompt_tokens", "Prompt tokens routed (as the router "
                                     "tokenized them).", ["backend"], registry=r)
        self.predicted_cached = Counter("kvserve_router_predicted_cached_tokens", "Prompt tokens predicted to be in "
                                        "the chosen backend's prefix cache.", ["backend"], registry=r)
        self.reported_cached = Counter("kvserve_router_reported_cached_tokens", "Cached prompt tokens the backend "
                                       "reported (usage.prompt_tokens_details.cached_tokens).", ["backend"], registry=r)
        r.register(_BackendCollector(backends))

    def routed(self, backend: str, prompt_tokens: int, predicted_cached: int) -> None:
        self.prompt_tokens.labels(backend).inc(prompt_tokens)
        self.predicted_cached.labels(backend).inc(predicted_cached)

    def render(self) -> bytes:
        return generate_latest(self.registry)
