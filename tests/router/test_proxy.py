"""The router's proxy without servers: backends are httpx mock transports that refuse, break, or answer.

Retries before the first byte, a stream broken mid-way ending in an error event, what is
forwarded, the choice by predicted cache hits; and the pieces under it (prompt hashes, the
backend's mirror, the stream watcher).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from kvserve.router.backends import Backend, BackendSet, normalize_url
from kvserve.router.metrics import RouterMetrics
from kvserve.router.monitor import Monitor
from kvserve.router.policy import CacheAware, RoundRobin
from kvserve.router.prefix import HashScheme, PromptHashes, block_hashes, cached_tokens
from kvserve.router.proxy import NoBackendError, Proxy, Route, forwarded_headers
from kvserve.router.relay import StreamWatch
from kvserve.errors import InvalidArgumentError

A, B = "http://a", "http://b"
SSE = {"content-type": "text/event-stream; charset=utf-8"}


class Chunks(httpx.AsyncByteStream):
    """A response body of the given chunks, then (``fail``) a broken connection."""

    def __init__(self, chunks: list[bytes], fail: bool = False):
        self.chunks = chunks
        self.fail = fail

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for c in self.chunks:
            yield c
        if self.fail:
            raise httpx.ReadError("connection reset by peer")


def make_proxy(handler: Callable[[httpx.Request], httpx.Response], urls=(A, B), policy=None):
    backends = BackendSet(urls)
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    metrics = RouterMetrics(lambda: backends)
    proxy = Proxy(backends, policy or RoundRobin(), Monitor(client), metrics, client)
    return proxy, backends, metrics


def route(stream: bool = False, **kw) -> Route:
    body = json.dumps({"model": "m", "prompt": "hi", "stream": stream}).encode()
    headers = forwarded_headers([(b"authorization", b"Bearer k"), (b"content-type", b"application/json")])
    return Route("POST", "/v1/completions", "", headers, body, stream=stream, **kw)


async def read(response) -> bytes:
    if hasattr(response, "relay"):
        try:
            return b"".join([c async for c in response.body_iterator])
        finally:
            await response.relay.close()
    return response.body


def metric(metrics: RouterMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_refused_connection_is_retried_on_another_backend_and_taken_out():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.host == "a":
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 16}}})

    async def main():
        proxy, backends, metrics = make_proxy(handler)
        resp = await proxy.forward(route(prompts=PromptHashes([[1] * 40])))
        assert resp.status_code == 200 and json.loads(await read(resp))["usage"]
        assert [r.url.host for r in seen] == ["a", "b"]
        assert not backends.get(A).healthy and backends.get(B).healthy
        assert backends.get(A).in_flight == backends.get(B).in_flight == 0
        assert metric(metrics, "kvserve_router_retries_total", backend=A) == 1
        assert metric(metrics, "kvserve_router_requests_total", backend=B, status="200") == 1
        assert metric(metrics, "kvserve_router_reported_cached_tokens_total", backend=B) == 16
        assert metric(metrics, "kvserve_router_prompt_tokens_total", backend=B) == 40
        # a is out: the next request goes straight to b
        seen.clear()
        await read(await proxy.forward(route()))
        assert [r.url.host for r in seen] == ["b"]

    asyncio.run(main())


def test_what_is_forwarded():
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer k"
        assert request.headers["accept-encoding"] == "identity"
        assert request.url.path == "/v1/completions" and request.url.query == b"x=1"
        assert json.loads(request.content)["prompt"] == "hi"
        return httpx.Response(201, content=b'{"ok": true}', headers={"content-type": "application/json", "x-y": "z"})

    async def main():
        proxy, *_ = make_proxy(handler, urls=(A,))
        r = route()
        r.query = "x=1"
        resp = await proxy.forward(r)
        assert resp.status_code == 201 and resp.body == b'{"ok": true}' and resp.headers["x-y"] == "z"

    asyncio.run(main())
    raw = [(b"Host", b"router"), (b"Content-Length", b"9"), (b"Connection", b"keep-alive"), (b"X-Session-Id", b"s"),
           (b"Accept-Encoding", b"gzip")]
    assert forwarded_headers(raw) == [("X-Session-Id", "s"), ("accept-encoding", "identity")]


def test_a_stream_that_breaks_before_its_first_byte_is_retried():
    events = [b'data: {"choices": [{"text": "x"}]}\n\n', b"data: [DONE]\n\n"]

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a":
            return httpx.Response(200, headers=SSE, stream=Chunks([], fail=True))
        return httpx.Response(200, headers=SSE, stream=Chunks(events))

    async def main():
        proxy, backends, metrics = make_proxy(handler)
        resp = await proxy.forward(route(stream=True))
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert await read(resp) == b"".join(events)  # byte for byte
        assert metric(metrics, "kvserve_router_retries_total", backend=A) == 1
        assert backends.get(B).in_flight == 0

    asyncio.run(main())


def test_a_stream_broken_mid_way_ends_with_an_error_event():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers=SSE, stream=Chunks([b'data: {"a": 1}\n\n', b'data: {"par'], fail=True))

    async def main():
        proxy, backends, metrics = make_proxy(handler, urls=(A,))
        body = await read(await proxy.forward(route(stream=True)))
        head, rest = body.split(b'data: {"par', 1)
        assert head == b'data: {"a": 1}\n\n'
        # the broken event is ended first, so the error is an event of its own
        assert rest.startswith(b"\n\ndata: {") and rest.endswith(b"\n\ndata: [DONE]\n\n")
        error = json.loads(rest.split(b"\n\n")[1][len(b"data: "):])["error"]
        assert error["type"] == "service_unavailable_error" and error["code"] == "backend_failed"
        assert "mid-stream" in error["message"]
        assert backends.get(A).in_flight == 0
        assert metric(metrics, "kvserve_router_stream_errors_total", backend=A) == 1

    asyncio.run(main())


def test_busy_or_dead_answers_are_retried_and_the_last_one_returned():
    def handler(request: httpx.Request) -> httpx.Response:
        status = 503 if request.url.host == "a" else 429
        return httpx.Response(status, json={"error": {"message": "no", "type": "t", "param": None, "code": None}})

    async def main():
        proxy, backends, metrics = make_proxy(handler)
        resp = await proxy.forward(route())
        assert resp.status_code == 429
        assert metric(metrics, "kvserve_router_retries_total", backend=A) == 1
        assert metric(metrics, "kvserve_router_retries_total", backend=B) == 1
        for b in backends:
            b.healthy = False
        with pytest.raises(NoBackendError):
            await proxy.forward(route())

    asyncio.run(main())


def test_the_backend_holding_the_prompt_is_chosen():
    scheme = HashScheme(b"root", 4)
    prompt = list(range(3, 20))  # 17 tokens: 4 full blocks of prompt[:-1]
    hashes = block_hashes(prompt, scheme)
    assert len(hashes) == 4

    async def main():
        proxy, backends, _ = make_proxy(lambda r: httpx.Response(200), policy=CacheAware())
        for b in backends:
            b.scheme = scheme
        backends.get(B).cached = set(hashes[:3])
        backends.get(A).cached = {hashes[0]}
        backend, predicted = proxy.choose(route(prompts=PromptHashes([prompt])))
        assert backend.url == B and predicted == 12
        backends.get(B).in_flight = 20  # too busy: past the load bound
        backend, predicted = proxy.choose(route(prompts=PromptHashes([prompt])))
        assert backend.url == A and predicted == 4

    asyncio.run(main())


def test_a_request_in_flight_counts_as_cached_where_it_was_sent_until_it_ends():
    """Its prompt blocks are predicted on its backend from the moment it is routed (so a follower with
    the same prefix goes there before the replica reports them), its uncached tokens count as queued
    prefill until its first byte, and both are released when it ends, on a failed attempt too."""
    scheme = HashScheme(b"root", 4)
    prompt = list(range(3, 20))  # 17 tokens: 4 full blocks of prompt[:-1]
    hashes = block_hashes(prompt, scheme)

    async def main():
        gate = asyncio.Event()

        class Gated(httpx.AsyncByteStream):
            async def __aiter__(self) -> AsyncIterator[bytes]:
                await gate.wait()  # the replica is still prefilling
                yield b'data: {"choices": [{"text": "x"}]}\n\n'
                yield b"data: [DONE]\n\n"

        def handler(request: httpx.Request) -> httpx.Response:
            if request.url.host == "a":
                raise httpx.ConnectError("connection refused", request=request)
            return httpx.Response(200, headers=SSE, stream=Gated())

        proxy, backends, _ = make_proxy(handler, policy=CacheAware())
        for b in backends:
            b.scheme = scheme
        a, b = backends.get(A), backends.get(B)
        first = asyncio.ensure_future(proxy.forward(route(stream=True, prompts=PromptHashes([prompt]))))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if b.in_flight:
                break
        # a refused it (and was taken out): nothing of the request is left there
        assert not a.computing and a.queued_tokens == 0 and not a.healthy
        assert set(b.computing) == set(hashes) and b.queued_tokens == 17 and not b.cached
        a.healthy = True
        follower = PromptHashes([prompt + [50, 51, 52, 53]])
        backend, predicted = proxy.choose(route(prompts=follower))
        assert backend is b and predicted == 16  # b computes it: 17 queued there < 1.25 x the 16 it saves
        gate.set()
        resp = await first
        assert b.queued_tokens == 0 and set(b.computing) == set(hashes)  # prefilled, still running
        await read(resp)
        assert not b.computing and b.in_flight == 0

    asyncio.run(main())


def test_prompt_hashes_follow_the_chain():
    scheme = HashScheme(b"r", 2)
    h = block_hashes([1, 2, 3, 4, 5], scheme)
    assert len(h) == 2 and block_hashes([1, 2, 3, 4], scheme) == h[:1]  # the last token is never matched
    assert block_hashes([9, 2, 3, 4, 5], scheme)[1] != h[1]  # a block's name depends on every token before it
    assert block_hashes([1, 2, 3, 4, 5], HashScheme(b"other model", 2)) != h
    assert cached_tokens(h, {h[0]}, 2) == 2 and cached_tokens(h, {h[1]}, 2) == 0
    ph = PromptHashes([[1, 2, 3, 4, 5], [1, 2, 7]])
    assert ph.cached_tokens(scheme, {h[0]}) == 4 and ph.cached_tokens(None, {h[0]}) == 0 and ph.num_tokens == 8
    assert HashScheme.from_json({"algorithm": "md5", "block_size": 2}) is None
    assert HashScheme.from_json({"algorithm": "blake2b-128-chain", "root_key": "00ff", "block_size": 2}) == \
        HashScheme(b"\x00\xff", 2)


def test_backend_mirror_applies_events_in_order():
    b = Backend(A)
    with pytest.raises(ValueError):  # an increment for a mirror that never had a snapshot
        b.apply_events({"epoch": "e", "seq": 1, "reset": False, "stored": ["aa"]})
    b.apply_events({"epoch": "e", "seq": 1, "reset": True, "stored": ["aa", "bb"],
                    "load": {"running": 2, "waiting": 1, "kv_usage": 0.5}})
    b.apply_events({"epoch": "e", "seq": 3, "reset": False, "stored": ["cc"], "removed": ["aa"]})
    assert b.cached == {b"\xbb", b"\xcc"} and b.seq == 3 and b.synced
    assert b.load == 3
    b.in_flight = 5
    assert b.load == 5  # the router's own count when it is fresher
    with pytest.raises(ValueError):  # another epoch needs a snapshot
        b.apply_events({"epoch": "f", "seq": 4, "reset": False})
    b.apply_events({"epoch": "f", "seq": 4, "reset": True, "stored": []})
    assert b.cached == set()
    assert normalize_url(" http://h:1/ ") == "http://h:1"
    with pytest.raises(InvalidArgumentError):
        normalize_url("h:1")


def test_stream_watch_finds_usage_across_chunks():
    w = StreamWatch()
    assert w.between_events
    event = b'data: {"choices": [], "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}}\n\n'
    for i in range(0, len(event), 7):
        w.feed(event[i:i + 7])
    assert w.cached_tokens == 32 and w.between_events
    w.feed(b'data: {"choi')
    assert not w.between_events


def test_router_flags():
    from kvserve.cli import build_parser
    from kvserve.router.config import RouterConfig, from_args

    a = build_parser().parse_args(["router", "--backend", "http://h:1", "--backend", "http://h:2", "--policy", "session",
                                   "--max-load-imbalance", "2", "--port", "9000"])
    cfg = from_args(a)
    assert cfg.backends == ["http://h:1", "http://h:2"] and cfg.policy == "session" and cfg.port == 9000
    assert cfg.max_load_imbalance == 2 and a.func.__name__ == "cmd_router"
    assert from_args(build_parser().parse_args(["router"])).policy == "cache-aware"
    with pytest.raises(InvalidArgumentError):
        RouterConfig(max_attempts=0)
    with pytest.raises(InvalidArgumentError):
        RouterConfig(policy="random")


def test_an_adapters_requests_go_where_it_is_loaded():
    """A backend that reported the LoRA adapter (its /kv/events' lora_adapters) gets its requests, even against the
    cache; the base model's and an adapter nobody has go by the policy as before."""
    scheme = HashScheme(b"root", 4)
    prompt = list(range(3, 20))
    hashes = block_hashes(prompt, scheme)

    async def main():
        proxy, backends, _ = make_proxy(lambda r: httpx.Response(200), policy=CacheAware())
        for b in backends:
            b.scheme = scheme
        backends.get(B).cached = set(hashes)
        backends.get(A).apply_events({"reset": True, "seq": 1, "epoch": "e", "lora_adapters": ["sql"]})
        assert backends.get(A).describe()["lora_adapters"] == ["sql"]
        for _ in range(3):
            assert proxy.choose(route(prompts=PromptHashes([prompt]), model="sql"))[0].url == A
        assert proxy.choose(route(prompts=PromptHashes([prompt]), model="m"))[0].url == B
        assert proxy.choose(route(prompts=PromptHashes([prompt]), model="other"))[0].url == B

    asyncio.run(main())
