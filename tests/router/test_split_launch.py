"""``kvserve serve --replicas 2 --prefill-replicas 1`` on a tiny random model, as a user runs it: one
prefill and one decode replica behind the router, with ``--api-key`` (the replicas get it, the router
asks their KV routes with it). Greedy answers through it equal a single replica's (streamed and not),
the decode replica restored the prompt's KV from the prefill replica, and SIGTERM stops the router and
every replica (exit 0, no process left)."""

from __future__ import annotations

import time

import httpx
import pytest

from router.test_replicas_e2e import alive, descendants, stop
from server_utils import spawn_serve

# float32, dense, SDPA on both paths: a restored prefix and a recomputed one agree to the bit
FLAGS = ["--dtype", "float32", "--quantization", "none", "--attention-backend", "gather-sdpa",
         "--num-kv-blocks", "256", "--max-num-batched-tokens", "64", "--uvicorn-log-level", "warning"]
PROMPT = "The quick brown fox jumps over the lazy dog. " * 6  # ~60 tokens: three full blocks
BODY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
AUTH = {"Authorization": "Bearer k"}


def complete(url: str, **extra) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={**BODY, **extra}, headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def streamed_text(url: str) -> str:
    import json

    text = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**BODY, "stream": True}, headers=AUTH,
                      timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += [c["text"] for c in json.loads(line[6:])["choices"]]
    return "".join(text)


@pytest.fixture(scope="module")
def single(tiny_model_dir, tmp_path_factory):
    proc, url = spawn_serve("--model", str(tiny_model_dir), "--num-threads", "1", "--api-key", "k", *FLAGS,
                            log=tmp_path_factory.mktemp("single") / "serve.log", timeout=300)
    try:
        yield complete(url)["choices"][0]["text"]
    finally:
        assert stop(proc) == 0


def test_one_prefill_one_decode_replica_answer_as_one_and_stop_cleanly(single, tiny_model_dir, tmp_path):
    proc, url = spawn_serve("--model", str(tiny_model_dir), "--replicas", "2", "--prefill-replicas", "1",
                            "--api-key", "k", *FLAGS, log=tmp_path / "serve.log", timeout=600)
    try:
        backends = httpx.get(f"{url}/admin/backends", headers=AUTH).json()["backends"]
        assert len(backends) == 1  # the decode replica (the prefill one is the router's other set)
        decode = backends[0]["url"]
        assert httpx.get(f"{decode}/kv/transfer").status_code == 401
        assert httpx.get(f"{decode}/kv/transfer", headers=AUTH).json()["role"] == "decode"
        got = complete(url)
        assert got["choices"][0]["text"] == single and single
        # the decode replica restored the prompt's full blocks from the prefill replica
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= got["usage"]["prompt_tokens"] - 16
        assert streamed_text(url) == single
        below = descendants(proc.pid)
        assert len(below) >= 4  # two replicas, each with its engine process
    finally:
        code = stop(proc)
    assert code == 0
    deadline = time.monotonic() + 30
    while any(alive(p) for p in below):
        assert time.monotonic() < deadline, [p for p in below if alive(p)]
        time.sleep(0.2)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)
