"""The router end to end: two replicas of the tiny random model behind ``kvserve router``'s app.

Greedy answers through the router are the replica's own (completions and chat, streamed and not);
prompts sharing a prefix go to the replica that cached it; a replica that goes down is taken out
and its request retried on the other; backends come and go through /admin.
"""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from kvserve.bench.prometheus import metric
from kvserve.config import KVServeConfig, ServerConfig
from kvserve.router.app import create_router_app
from kvserve.router.config import RouterConfig
from kvserve.router.prefix import HashScheme, block_hashes
from kvserve.router.prompt import PromptTokenizer
from kvserve.server.engine_client import AsyncEngineClient
from server_utils import AppThread, ServerThread

ENGINE = dict(dtype="float32", num_threads=1, num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=512)
GREEDY = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def replica(model_dir, name: str, engine: dict = ENGINE, **kw) -> ServerThread:
    client = AsyncEngineClient(KVServeConfig.from_kwargs(model=str(model_dir), **engine, **kw))
    return ServerThread(client, ServerConfig(served_model_names=["tiny"], replica_id=name))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return PromptTokenizer.load(str(tiny_model_dir)).tokenizer


@pytest.fixture(scope="module")
def replicas(tiny_model_dir):
    with replica(tiny_model_dir, "r1") as r1, replica(tiny_model_dir, "r2") as r2:
        yield r1, r2


def start_router(tokenizer, *backends: str, **settings) -> AppThread:
    config = RouterConfig(backends=list(backends), **{"health_interval_s": 0.5, "events_wait_s": 0.5, **settings})
    return AppThread(create_router_app(config, PromptTokenizer(tokenizer)))  # (the router closes its own)


@pytest.fixture(scope="module")
def router(replicas, tokenizer):
    with start_router(tokenizer, *(r.url for r in replicas)) as r:
        wait_until(lambda: all(b["synced"] for b in backends(r.url)))
        yield r


def wait_until(cond, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def backends(url: str) -> list[dict]:
    return httpx.get(f"{url}/admin/backends").json()["backends"]


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers={"Authorization": "Bearer unused"}, timeout=60)


def stream_text(url: str, path: str, body: dict) -> tuple[str, bytes]:
    """The text of a streamed answer, and the raw bytes of the stream."""
    raw = b""
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for chunk in r.iter_raw():
            raw += chunk
    text = []
    for line in raw.decode().split("\n"):
        if line.startswith("data: {") and json.loads(line[6:])["choices"]:
            choice = json.loads(line[6:])["choices"][0]
            text.append(choice["text"] if "text" in choice else choice["delta"].get("content") or "")
    return "".join(text), raw


def answer(resp: httpx.Response) -> tuple[str, int, int]:
    assert resp.status_code == 200, resp.text
    out = resp.json()
    choice = out["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    return text, out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "The quick brown fox jumps over the lazy dog. " * 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi there, what is a KV cache?"}]}),
], ids=["completions", "chat"])
def test_greedy_answers_through_the_router_are_the_replicas(router, replicas, path, body):
    body = {**GREEDY, **body}
    direct = answer(post(replicas[0].url, path, body))
    assert answer(post(router.url, path, body)) == direct
    text, raw = stream_text(router.url, path, body)
    direct_text, direct_raw = stream_text(replicas[0].url, path, body)
    assert text == direct_text == direct[0]
    assert raw.endswith(b"data: [DONE]\n\n") and direct_raw.endswith(b"data: [DONE]\n\n")
    models = httpx.get(f"{router.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    # the router tokenized the prompt as the replica did
    assert metric(httpx.get(f"{router.url}/metrics").text, "kvserve_router_prompt_tokens_total") > 0


def test_a_shared_prefix_goes_to_the_replica_that_cached_it(router, replicas):
    rng = random.Random(7)
    shared = [rng.randrange(3, 49152) for _ in range(48)]  # three full blocks
    first = post(router.url, "/v1/completions", {**GREEDY, "prompt": shared + [11, 12]})
    assert first.status_code == 200
    scheme = HashScheme.from_json(httpx.get(f"{replicas[0].url}/kv/events").json()["hash_scheme"])
    mine = {h.hex() for h in block_hashes(shared + [11, 12], scheme)}
    assert len(mine) == 3
    holders = [r for r in replicas if mine <= set(httpx.get(f"{r.url}/kv/events").json()["stored"])]
    assert len(holders) == 1
    holder = holders[0]
    seq = httpx.get(f"{holder.url}/kv/events").json()["seq"]
    wait_until(lambda: (next(b for b in backends(router.url) if b["url"] == holder.url)["events_seq"] or 0) >= seq)

    before = httpx.get(f"{router.url}/metrics").text
    for i in range(4):
        out = post(router.url, "/v1/completions", {**GREEDY, "prompt": shared + [100 + i, 200 + i]}).json()
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 48  # served from the holder's cache
    after = httpx.get(f"{router.url}/metrics").text

    def grew(name: str, url: str) -> float:
        def value(text: str) -> float:
            try:
                return metric(text, name, backend=url)
            except KeyError:
                return 0.0
        return value(after) - value(before)

    other = next(r for r in replicas if r is not holder)
    assert grew("kvserve_router_requests_total", holder.url) == 4
    assert grew("kvserve_router_requests_total", other.url) == 0
    assert grew("kvserve_router_predicted_cached_tokens_total", holder.url) == 4 * 48
    assert grew("kvserve_router_reported_cached_tokens_total", holder.url) == 4 * 48


def test_a_backend_that_goes_down_is_retried_elsewhere_and_taken_out(replicas, tokenizer, tiny_model_dir):
    live = replicas[0].url
    doomed = replica(tiny_model_dir, "r3").__enter__()
    dead, stopped = doomed.url, False
    try:
        # round robin, and health checks too rare to notice: the requests themselves find out
        with start_router(tokenizer, live, dead, policy="round-robin", health_interval_s=60) as r:
            wait_until(lambda: all(b["synced"] for b in backends(r.url)))
            doomed.__exit__(None, None, None)
            stopped = True
            for _ in range(2):  # one of the two is sent to the dead backend first
                assert answer(post(r.url, "/v1/completions", {**GREEDY, "prompt": "Hello there"}))[2] == 8
            text = httpx.get(f"{r.url}/metrics").text
            assert metric(text, "kvserve_router_retries_total", backend=dead) == 1
            assert metric(text, "kvserve_router_backend_healthy", backend=dead) == 0
            streamed, _ = stream_text(r.url, "/v1/completions", {**GREEDY, "prompt": "Hello there"})
            assert streamed
    finally:
        if not stopped:
            doomed.__exit__(None, None, None)

    # with regular health checks, a dead backend is out within seconds, without a request
    with start_router(tokenizer, live, dead, health_interval_s=0.2) as r:
        wait_until(lambda: not next(b for b in backends(r.url) if b["url"] == dead)["healthy"], timeout=5)
        assert httpx.get(f"{r.url}/health").json()["healthy"] == 1
        # backends come and go at run time
        gone = httpx.request("DELETE", f"{r.url}/admin/backends", json={"url": live})
        assert gone.status_code == 200 and gone.json() == {"removed": live}
        httpx.delete(f"{r.url}/admin/backends", params={"url": dead})
        down = httpx.get(f"{r.url}/health")
        assert down.status_code == 503 and down.json()["error"]["type"] == "service_unavailable_error"
        refused = post(r.url, "/v1/completions", {**GREEDY, "prompt": "Hello"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_backend"
        added = httpx.post(f"{r.url}/admin/backends", json={"url": live + "/"})
        assert added.status_code == 200 and added.json()["healthy"] and added.json()["url"] == live
        assert answer(post(r.url, "/v1/completions", {**GREEDY, "prompt": "Hello"}))[2] == 8
        bad = httpx.post(f"{r.url}/admin/backends", json={"url": "localhost:1"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"


def test_session_policy_keeps_a_user_on_one_replica(replicas, tokenizer):
    rng = random.Random(11)
    with start_router(tokenizer, *(r.url for r in replicas), policy="session") as r:
        wait_until(lambda: all(b["synced"] for b in backends(r.url)))

        def counts() -> dict[str, float]:
            text = httpx.get(f"{r.url}/metrics").text
            out = {}
            for rep in replicas:
                try:
                    out[rep.url] = metric(text, "kvserve_router_requests_total", backend=rep.url, status="200")
                except KeyError:
                    out[rep.url] = 0.0
            return out

        for who, how in (("alice", "header"), ("bob", "user"), ("carol", "header")):
            before = counts()
            for _ in range(3):  # unrelated prompts: no cache pulls them anywhere
                body = {**GREEDY, "prompt": [rng.randrange(3, 49152) for _ in range(20)]}
                if how == "user":
                    resp = post(r.url, "/v1/completions", {**body, "user": who})
                else:
                    resp = httpx.post(f"{r.url}/v1/completions", json=body, headers={"X-Session-Id": who}, timeout=60)
                assert resp.status_code == 200
            after = counts()
            grew = sorted(after[u] - before[u] for u in after)
            assert grew == [0, 3], (who, before, after)  # all three on one replica
