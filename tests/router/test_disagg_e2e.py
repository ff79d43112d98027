"""Disaggregated prefill and decode end to end: a prefill and a decode replica of the tiny random model
behind ``kvserve router --prefill URL --decode URL``.

Greedy answers through the split equal a plain replica's (completions and chat, streamed and not), the
decode replica restores the prompt's KV the prefill replica sent; with the prefill replica gone, requests
go whole to a decode replica and answer the same; bad ``kv_transfer_params`` are a 400; with ``--api-key`` the KV routes need the key and the router
sends its ``--backend-api-key`` to them.
"""

from __future__ import annotations

import httpx
import pytest

from kvserve.config import KVServeConfig, ServerConfig
from kvserve.router.app import create_router_app
from kvserve.router.config import RouterConfig
from kvserve.router.prompt import PromptTokenizer
from kvserve.server.engine_client import AsyncEngineClient
from server_utils import AppThread, ServerThread
from router.test_router_e2e import answer, post, stream_text, tokenizer  # noqa: F401 (a fixture)
from router.test_router_e2e import replica as router_replica

# float32, dense, SDPA on both paths: a restored prefix and a recomputed one agree to the bit
ENGINE = dict(dtype="float32", quantization="none", attention_backend="gather-sdpa", num_threads=1,
              num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=64)
GREEDY = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
PROMPT = "The quick brown fox jumps over the lazy dog. " * 6  # ~60 tokens: three chunks, three full blocks


def replica(model_dir, name: str, **kw) -> ServerThread:
    return router_replica(model_dir, name, ENGINE, **kw)


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    with replica(tiny_model_dir, "plain") as plain, replica(tiny_model_dir, "p", role="prefill") as p, \
            replica(tiny_model_dir, "d", role="decode") as d:
        yield plain, p, d


def router(tokenizer, prefill: list[str], decode: list[str]) -> AppThread:
    config = RouterConfig(prefill=prefill, decode=decode, health_interval_s=0.5, events_wait_s=0.5)
    return AppThread(create_router_app(config, PromptTokenizer(tokenizer)))


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
], ids=["completions", "chat"])
def test_split_answers_equal_one_replica(servers, tokenizer, path, body):
    plain, p, d = servers
    body = {**GREEDY, **body}
    want = answer(post(plain.url, path, body))
    with router(tokenizer, [p.url], [d.url]) as r:
        resp = post(r.url, path, body)
        assert answer(resp) == want
        # the decode replica had the prompt's full blocks from the prefill replica: only the last is computed
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= want[1] - 16
        text, raw = stream_text(r.url, path, body)
        assert text == want[0] and raw.endswith(b"data: [DONE]\n\n")
        assert r.app.state.router.split.stats["split"] == 2
    assert httpx.get(f"{d.url}/kv/transfer").json()["address"]


def test_prefill_replica_down_the_request_goes_whole(servers, tokenizer):
    plain, _, d = servers
    body = {**GREEDY, "prompt": PROMPT + " again"}
    want = answer(post(plain.url, "/v1/completions", body))
    with router(tokenizer, ["http://127.0.0.1:9"], [d.url]) as r:  # nothing listens there
        assert answer(post(r.url, "/v1/completions", body)) == want
        assert r.app.state.router.split.stats["prefill_fallbacks"] == 1


def test_unsplittable_request_goes_whole_and_bad_params_are_400(servers, tokenizer):
    plain, p, d = servers
    body = {**GREEDY, "prompt": PROMPT, "n": 2}
    want = post(plain.url, "/v1/completions", body).json()["choices"]
    with router(tokenizer, [p.url], [d.url]) as r:
        got = post(r.url, "/v1/completions", body)
        assert got.status_code == 200 and [c["text"] for c in got.json()["choices"]] == [c["text"] for c in want]
        assert r.app.state.router.split.stats["whole"] == 1
    bad = post(d.url, "/v1/completions", {**GREEDY, "prompt": "x", "kv_transfer_params": {"transfer_id": 3}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_transfer_params"
    both = post(plain.url, "/v1/completions", {**GREEDY, "prompt": "x",
                                               "kv_transfer_params": {"transfer_id": "t", "first_token_ids": [5]}})
    assert both.status_code == 400 and "no KV connector" in both.json()["error"]["message"]


def keyed_replica(model_dir, name: str, key: str, **kw) -> ServerThread:
    """A replica with ``--api-key key`` (its HTTP routes and its KV connector both check it)."""
    client = AsyncEngineClient(KVServeConfig.from_kwargs(model=str(model_dir), api_key=key, **ENGINE, **kw))
    return ServerThread(client, ServerConfig(served_model_names=["tiny"], replica_id=name, api_key=key))


def test_kv_routes_need_the_api_key_and_the_router_sends_it(servers, tiny_model_dir, tokenizer):
    plain = servers[0]
    body = {**GREEDY, "prompt": PROMPT + " keyed"}
    want = answer(post(plain.url, "/v1/completions", body))
    auth = {"Authorization": "Bearer k"}
    with keyed_replica(tiny_model_dir, "kp", "k", role="prefill") as p, \
            keyed_replica(tiny_model_dir, "kd", "k", role="decode") as d:
        for url in (p.url, d.url):
            for path in ("/kv/transfer", "/kv/events"):
                assert httpx.get(url + path).status_code == 401
                assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(d.url + "/kv/transfer", headers=auth).json()["address"]
        config = RouterConfig(prefill=[p.url], decode=[d.url], health_interval_s=0.5, events_wait_s=0.5,
                              backend_api_key="k")
        with AppThread(create_router_app(config, PromptTokenizer(tokenizer))) as r:
            resp = httpx.post(r.url + "/v1/completions", json=body, headers=auth, timeout=60)
            assert answer(resp) == want
            assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= want[1] - 16
            assert r.app.state.router.split.stats == {"split": 1, "whole": 0, "prefill_fallbacks": 0, "prefill_only": 0}


def test_one_token_request_is_answered_by_a_prefill_replica_alone(servers, tokenizer):
    """Its prefill is all of it: no KV goes to a decode replica (which would only drop it)."""
    plain, p, d = servers
    body = {**GREEDY, "prompt": PROMPT + " once", "max_tokens": 1}
    want = answer(post(plain.url, "/v1/completions", body))
    with router(tokenizer, [p.url], [d.url]) as r:
        assert answer(post(r.url, "/v1/completions", body)) == want
        text, _ = stream_text(r.url, "/v1/completions", body)
        assert text == want[0]
        assert r.app.state.router.split.stats == {"split": 0, "whole": 0, "prefill_fallbacks": 0, "prefill_only": 2}
