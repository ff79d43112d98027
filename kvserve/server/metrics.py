"""Prometheus metrics of one server: engine gauges and counters, and per-request latencies.

Names mirror vLLM's (``vllm:x`` is ``kvserve_x``: a colon is reserved for recording rules, and
``promtool check metrics`` passes; docs/observability.md). Engine-side numbers come from the latest
stats snapshot the engine process sent, read at scrape time; latencies are measured in the
API process as tokens reach the HTTP handlers. Each app has its own CollectorRegistry, so
tests can build several apps in one process.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.server.engine_client import EngineClient
from kvserve.spec.policy import SpecStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 10.0)
_HANDOFF_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1)


class _EngineCollector(Collector):
    """Reads the engine's latest snapshot at each scrape."""

    def __init__(self, client: EngineClient, model_name: str):
        self.client = client
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.client.stats
        labels = ["model_name"]
        values = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("kvserve_num_requests_running", "Requests in the engine's running batch.", s.num_running)
        yield gauge("kvserve_num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("kvserve_kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
                    s.kv_cache_usage)
        yield gauge("kvserve_kv_cache_blocks_used", "KV cache blocks in use.", s.kv_blocks_used)
        yield gauge("kvserve_kv_cache_blocks_capacity", "KV cache blocks in the pool.", s.kv_blocks_total)
        yield gauge("kvserve_kv_cache_bytes_per_token", "Bytes of one token's K and V (all layers) as the KV cache "
                    "stores them (--kv-cache-dtype).", s.kv_bytes_per_token)
        if s.resident_memory_bytes is not None:
            yield gauge("kvserve_engine_resident_memory_bytes", "Resident memory of the engine process (RSS; "
                        "process_resident_memory_bytes is the API process's).", s.resident_memory_bytes)
        yield counter("kvserve_num_preemptions", "Requests preempted (KV freed, recomputed later).",
                      s.num_preemptions)
        yield counter("kvserve_prompt_tokens", "Prefill tokens computed.", s.prompt_tokens)
        yield counter("kvserve_generation_tokens", "Tokens generated.", s.generation_tokens)
        p = s.prefix_cache
        yield gauge("kvserve_kv_cache_blocks_cached", "KV blocks held by the prefix cache (evictable when idle).",
                    s.kv_blocks_cached)
        hits = CounterMetricFamily("kvserve_prefix_cache_hits_by_tier", "Prompt tokens whose KV was reused, by the "
                                   "tier it came from (device: shared in place; host, disk: copied back).",
                                   labels=labels + ["tier"])
        for tier, n in (("device", p.device_hits), *sorted(p.tier_hits.items())):
            hits.add_metric(values + [tier], n)
        yield hits
        yield counter("kvserve_kv_evicted_blocks", "Prefix-cache blocks evicted from device memory.", p.evicted_blocks)
        moved = CounterMetricFamily("kvserve_kv_offload_bytes", "Bytes of KV copied device -> tiers (out) and "
                                    "tiers -> device (in).", labels=labels + ["direction"])
        moved.add_metric(values + ["out"], p.offload_bytes_out)
        moved.add_metric(values + ["in"], p.offload_bytes_in)
        yield moved
        yield counter("kvserve_kv_offload_restores_skipped", "Tier hits not restored because prefilling again "
                      "was predicted to be cheaper.", p.restores_skipped)
        g = s.grammar
        if g is not None:
            yield counter("kvserve_grammar_compiles", "Structured-output grammars compiled.", g.compiles)
            yield counter("kvserve_grammar_cache_hits", "Structured-output requests whose grammar was cached.", g.hits)
            yield counter("kvserve_grammar_compile_seconds", "Time spent compiling grammars (off the engine loop).",
                          g.compile_seconds_total)
            yield counter("kvserve_grammar_cache_evictions", "Compiled grammars evicted (LRU).", g.evictions)
            yield counter("kvserve_grammar_compile_errors", "Schemas and grammars refused as invalid.", g.errors)
            yield gauge("kvserve_grammar_cache_size", "Compiled grammars cached.", g.size)
        method = self.client.config.speculation.speculative_method
        if method:
            yield from _spec_metrics(s.spec, values + [method], labels + ["method"])


def _spec_metrics(st: SpecStats, values: list[str], labels: list[str]) -> Iterator[Metric]:
    """Speculative decoding, vLLM's names: drafts verified, tokens drafted, accepted and emitted,
    and how many drafts each verify accepted."""
    for name, doc, v in (
        ("num_drafts", "Verify steps (a decode with at least one drafted token).", st.num_verifies),
        ("num_draft_tokens", "Drafted tokens verified by the target model.", st.num_draft_tokens),
        ("num_accepted_tokens", "Drafted tokens the target model accepted.", st.num_accepted_tokens),
        ("num_emitted_tokens", "Tokens emitted by verify steps (accepted drafts plus the target's own).",
         st.num_emitted_tokens),
    ):
        c = CounterMetricFamily(f"kvserve_spec_decode_{name}", doc, labels=labels)
        c.add_metric(values, v)
        yield c
    h = HistogramMetricFamily("kvserve_spec_decode_accepted_length", "Drafted tokens accepted per verify step.",
                              labels=labels)
    cumulative, buckets = 0, []
    for m, count in enumerate(st.accepted_length_counts):
        cumulative += count
        buckets.append((str(float(m)), cumulative))
    buckets.append(("+Inf", cumulative))
    total = sum(m * c for m, c in enumerate(st.accepted_length_counts))
    h.add_metric(values, buckets, total)
    yield h


class _Histogram(Collector):
    """A histogram for the event loop's hot path: observing is a bisect and two additions.

    prometheus_client's Histogram takes a lock and walks every bucket per observation; with one
    observation per token per stream that was a visible share of the API process's CPU. Only
    the event loop thread observes, so no lock is needed; scrapes read a consistent-enough copy.
    """

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], model_name: str):
        self.name, self.doc, self.model_name = name, doc, model_name
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def collect(self) -> Iterator[Metric]:
        h = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts):
            cumulative += count
            buckets.append((bound, cumulative))
        h.add_metric([self.model_name], buckets, self.sum)
        yield h


class ServerMetrics:
    """The app's registry; also the client's RequestObserver (see kvserve.server.request_stream)."""

    def __init__(self, client: EngineClient, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(client, model_name))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes etc. of the API process
        reg, name = self.registry, model_name
        self.ttft = _Histogram("kvserve_time_to_first_token_seconds", "Time from arrival to the first token.",
                               _LATENCY_BUCKETS, name)
        self.itl = _Histogram("kvserve_inter_token_latency_seconds", "Time between two tokens of a request.",
                              _ITL_BUCKETS, name)
        self.e2e = _Histogram("kvserve_e2e_request_latency_seconds", "Time from arrival to the last token.",
                              _LATENCY_BUCKETS, name)
        self.handoff = _Histogram("kvserve_engine_handoff_seconds",
                                  "Time from the end of an engine step to its tokens reaching the HTTP handler.",
                                  _HANDOFF_BUCKETS, name)
        for h in (self.ttft, self.itl, self.e2e, self.handoff):
            reg.register(h)
        self._success = Counter("kvserve_request_success", "Requests finished, by reason.",
                                ["model_name", "finished_reason"], registry=reg)
        self._name = name
        self.http_requests = Counter("kvserve_http_requests", "HTTP responses, by route and status code "
                                     "(refusals before the engine included).", ["route", "status"], registry=reg)
        self.prefix_queries = Counter("kvserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      ["model_name"], registry=reg).labels(name)
        self.prefix_hits = Counter("kvserve_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   ["model_name"], registry=reg).labels(name)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- RequestObserver ---------------------------------------------------------------------
    def on_handoff(self, seconds: float) -> None:
        self.handoff.observe(seconds)

    def on_first_token(self, ttft: float, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.ttft.observe(ttft)
        self.prefix_queries.inc(num_prompt_tokens)
        self.prefix_hits.inc(num_cached_tokens)

    def on_tokens(self, inter_token_latency: float, num_tokens: int) -> None:
        itl = self.itl
        i = bisect_left(itl.bounds, inter_token_latency)
        itl.counts[i] += num_tokens
        itl.sum += inter_token_latency * num_tokens

    def on_finish(self, finish_reason: str, e2e_latency: float) -> None:
        self._success.labels(self._name, finish_reason).inc()
        self.e2e.observe(e2e_latency)
