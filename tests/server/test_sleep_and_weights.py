"""The server's model admin routes: vLLM's sleep mode (``POST /sleep``, ``/wake_up``, ``GET /is_sleeping``,
``/health``) and SGLang's ``POST /update_weights_from_disk``, over one engine process on tiny random Llamas."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from conftest import tiny_hf_model
from kvserve import LLM, SamplingParams
from kvserve.bench.sse import DONE, alines, payload
from kvserve.config import KVServeConfig, ServerConfig
from kvserve.server.engine_client import AsyncEngineClient
from server_utils import TINY_ENGINE, ServerThread

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
KV_GB = 0.25  # a pool big enough that freeing it shows in the engine's resident memory
ENGINE = {**TINY_ENGINE, "num_kv_blocks": None, "kv_cache_memory_gb": KV_GB, "quantization": "none"}


@pytest.fixture(scope="module")
def weights(tmp_path_factory, embedded_hf_tokenizer):
    """The --weights-dir: tiny Llamas of one shape with other weights (a, b) and one layer more (deep)."""
    root = tmp_path_factory.mktemp("weights")
    for name, kw in {"a": dict(seed=3), "b": dict(seed=5), "deep": dict(seed=3, layers=3)}.items():
        tiny_hf_model(vocab=49152, **kw).save_pretrained(root / name)
        embedded_hf_tokenizer.save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def server(weights):
    client = AsyncEngineClient(KVServeConfig.from_kwargs(model=str(weights / "a"), **ENGINE))
    config = ServerConfig(served_model_names=["tiny"], api_key=KEY, weights_dir=str(weights))
    with ServerThread(client, config) as s:
        yield s


def prompt(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def complete(url: str, p: list[int], max_tokens: int = 8) -> dict:
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60, json={
        "model": "tiny", "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    return {"ids": body["choices"][0]["token_ids"], "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


def post(url: str, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", headers=AUTH, timeout=120, **kw)


def offline(folder, p: list[int], n: int = 8) -> list[int]:
    llm = LLM(str(folder), **{**TINY_ENGINE, "quantization": "none"})
    return llm.generate([p], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].token_ids


async def stream_and(url: str, p: list[int], max_tokens: int, path: str, **kw) -> tuple[list[dict], httpx.Response]:
    """Open a stream of ``p``; once its first token came, POST ``path``. Returns the stream's events and the
    POST's response."""
    async with httpx.AsyncClient(timeout=120, headers=AUTH) as c:
        events: list[dict] = []
        first = asyncio.Event()

        async def read() -> None:
            async with c.stream("POST", f"{url}/v1/completions", json={
                    "model": "tiny", "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "return_token_ids": True}) as r:
                async for line in alines(r.aiter_text()):
                    data = payload(line)
                    if data is not None and data != DONE:
                        events.append(json.loads(data))
                        first.set()
            first.set()

        reader = asyncio.create_task(read())
        await first.wait()
        response = await c.post(f"{url}{path}", **kw)
        await reader
        return events, response


def stream_tokens(events: list[dict]) -> list[int]:
    return [t for e in events if "choices" in e for c in e["choices"] for t in c.get("token_ids") or ()]


def engine_rss(server) -> int:
    return server.client.stats.resident_memory_bytes or 0


def test_sleep_then_wake_gives_the_same_answers_and_frees_the_kv_cache(server):
    url, p = server.url, prompt(1)
    want = complete(url, p)["ids"]
    for level in (1, 2):
        awake = engine_rss(server)
        r = post(url, f"/sleep?level={level}")
        assert r.status_code == 200 and r.json()["is_sleeping"] and r.json()["level"] == level
        # the pool's pages are returned: the engine's resident memory falls by most of the pool
        assert awake - engine_rss(server) > 0.8 * KV_GB * (1 << 30)
        assert httpx.get(f"{url}/is_sleeping", headers=AUTH).json() == {"is_sleeping": True}
        assert httpx.get(f"{url}/health").json() == {"status": "sleeping", "sleep_level": level}
        r = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"model": "tiny", "prompt": p, "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "sleeping"
        r = post(url, "/wake_up")
        assert r.status_code == 200 and r.json()["is_sleeping"] is False
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        assert complete(url, p) == {"ids": want, "cached": 0}  # the same answer; the device cache was dropped
    assert post(url, "/sleep?level=3").status_code == 400


def test_a_sleep_waits_for_the_stream_in_flight(server):
    url, p = server.url, prompt(2)
    events, r = asyncio.run(stream_and(url, p, 64, "/sleep?level=1"))
    try:
        assert r.status_code == 200
        assert len(stream_tokens(events)) == 64 and events[-1]["choices"][0]["finish_reason"] == "length"
        assert server.client.stats.num_running == 0
    finally:
        assert post(url, "/wake_up").status_code == 200


def test_an_update_lets_the_stream_in_flight_finish_then_serves_the_new_weights(server, weights):
    url, p, q = server.url, prompt(3), prompt(4)
    want_a, want_b = offline(weights / "a", p, 48), offline(weights / "b", q)
    complete(url, q)
    assert complete(url, q)["cached"] == 32  # q is in the prefix cache
    events, r = asyncio.run(stream_and(url, p, 48, "/update_weights_from_disk", json={"model_path": "b"}))
    try:
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        assert stream_tokens(events) == want_a  # finished on the weights it started with
        assert complete(url, q) == {"ids": want_b, "cached": 0}  # a miss: computed by the new weights
        assert complete(url, q)["cached"] == 32
    finally:
        assert post(url, "/update_weights_from_disk", json={"model_path": str(weights / "a")}).status_code == 200


def test_an_update_that_aborts_ends_the_stream_with_an_error(server, weights):
    url, p = server.url, prompt(5)
    events, r = asyncio.run(stream_and(url, p, 400, "/update_weights_from_disk",
                                       json={"model_path": "b", "abort_all_requests": True}))
    try:
        assert r.status_code == 200, r.text
        assert len(stream_tokens(events)) < 400
        assert events[-1]["error"]["code"] == "weights_updated" and "aborted" in events[-1]["error"]["message"]
        assert complete(url, p)["ids"] == offline(weights / "b", p)
    finally:
        assert post(url, "/update_weights_from_disk", json={"model_path": "a"}).status_code == 200


@pytest.mark.parametrize("body, status, message", [
    ({}, 400, "model_path"),
    ({"model_path": "deep"}, 400, "cannot replace the served model: model.layers.2"),
    ({"model_path": "nowhere"}, 400, "no such file or folder"),
    ({"model_path": "../.."}, 400, "must lie in the server's --weights-dir"),
    ({"model_path": "a", "load_format": "pt"}, 400, "unknown load format"),
])
def test_a_bad_update_is_a_400_and_the_server_keeps_serving(server, weights, body, status, message):
    p = prompt(6)
    want = complete(server.url, p)["ids"]
    r = post(server.url, "/update_weights_from_disk", json=body)
    assert r.status_code == status and message in r.json()["error"]["message"], r.text
    assert complete(server.url, p) == {"ids": want, "cached": 32}  # same weights, cache kept


def test_the_admin_routes_need_the_api_key(server):
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                         ("POST", "/update_weights_from_disk")):
        r = httpx.request(method, f"{server.url}{path}", json={"model_path": "b"})
        assert r.status_code == 401, path
    assert httpx.get(f"{server.url}/is_sleeping", headers=AUTH).json() == {"is_sleeping": False}
