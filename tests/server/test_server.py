"""The HTTP server end to end: OpenAI clients, concurrency, errors, aborts, metrics, SIGTERM.

Most tests share one server on a tiny random Llama saved as a Hugging Face folder (``--model
<dir>``, the real loading path) with the embedded tokenizer; the `openai` client tests run on
the embedded SmolLM2 model, whose text means something.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import socket
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from kvserve import SamplingParams
from kvserve.bench import sse
from kvserve.bench.prometheus import metric
from kvserve.config import KVServeConfig, ServerConfig
from kvserve.server.engine_client import AsyncEngineClient
from server_utils import ServerThread, spawn_serve, wait_for_metrics

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY = 1 << 20
TINY_ENGINE = dict(dtype="float32", num_threads=1, num_kv_blocks=512, max_num_seqs=64, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir):
    client = AsyncEngineClient(KVServeConfig.from_kwargs(model=str(tiny_model_dir), **TINY_ENGINE))
    with ServerThread(client, ServerConfig(served_model_names=["tiny"], api_key=API_KEY, max_request_bytes=MAX_BODY)) as server:
        yield server


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    from kvserve.llm import LLM

    return LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=512, max_num_batched_tokens=512)


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def stream_completion(url: str, body: dict, headers: dict = AUTH) -> tuple[str, list]:
    """Text and events of a streamed completion read with httpx."""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=headers,
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = list(sse.events(sse.lines(r.iter_text())))
    assert events[-1] == "[DONE]"
    return "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]), events


# --------------------------------------------------------------------------- the openai client


@pytest.mark.e2e
def test_openai_client_on_embedded_model(embedded_hf_tokenizer):
    import openai

    from kvserve.text.tokenizer import Tokenizer

    # float32 and dense weights: the stream is compared token for token with a request that ran in another
    # batch shape (its prompt then half cached), and quantized activations can round differently there
    client = AsyncEngineClient(KVServeConfig.from_kwargs(dtype="float32", quantization="none", num_threads=1,
                                            kv_cache_memory_gb=0.25, max_num_batched_tokens=256),
                               tokenizer=Tokenizer(embedded_hf_tokenizer))
    with ServerThread(client, ServerConfig(served_model_names=["smol"])) as server:
        oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in oa.models.list().data] == ["smol"]

        prompt = "The capital of France is"
        full = oa.completions.create(model="smol", prompt=prompt, max_tokens=16, temperature=0)
        assert full.choices[0].finish_reason in ("length", "stop") and full.choices[0].text.strip()
        assert full.usage.prompt_tokens == len(embedded_hf_tokenizer.encode(prompt))
        assert full.usage.prompt_tokens_details.cached_tokens == 0
        chunks = list(oa.completions.create(model="smol", prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
        assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens

        messages = [{"role": "system", "content": "You are brief."},
                    {"role": "user", "content": "Name a primary colour."}]
        chat = oa.chat.completions.create(model="smol", messages=messages, max_completion_tokens=24, temperature=0)
        answer = chat.choices[0].message.content
        assert answer.strip() and chat.choices[0].message.role == "assistant"
        parts = list(oa.chat.completions.create(model="smol", messages=messages, max_completion_tokens=24,
                                                temperature=0, stream=True, stream_options={"include_usage": True}))
        assert parts[0].choices[0].delta.role == "assistant"
        assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == answer
        assert parts[-1].usage.total_tokens == chat.usage.total_tokens
        assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == chat.choices[0].finish_reason

        with pytest.raises(openai.NotFoundError) as e:  # 404, as OpenAI and vLLM answer
            oa.chat.completions.create(model="other", messages=messages)
        assert e.value.body["code"] == "model_not_found"


# --------------------------------------------------------------------------- the tiny server


def test_concurrent_streams_match_offline_greedy(tiny_server, offline):
    import openai

    prompts = random_prompts(32, seed=1)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = [o.text for o in offline.generate(prompts, params)]

    async def run() -> list[str]:
        oa = openai.AsyncOpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY, max_retries=0)

        async def one(p: list[int]) -> str:
            stream = await oa.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream if c.choices])

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await oa.close()

    assert asyncio.run(run()) == expected


def test_completion_variants(tiny_server, offline):
    url, prompts = tiny_server.url, random_prompts(2, seed=2)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [o.text for o in offline.generate(prompts, greedy)]
    body = {"prompt": prompts, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "n": 2}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in r["choices"]] == [want[0], want[0], want[1], want[1]]
    assert r["usage"]["prompt_tokens"] == sum(map(len, prompts)) and r["usage"]["completion_tokens"] == 32

    # a string prompt, logprobs, a stop string
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60, json={
        "prompt": "Hello", "max_tokens": 6, "temperature": 0, "logprobs": 2, "ignore_eos": True}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 6 and all(len(t) == 2 for t in lp["top_logprobs"])
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    text = r["choices"][0]["text"]
    stop = text[3:6]
    s = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60, json={
        "prompt": "Hello", "max_tokens": 6, "temperature": 0, "stop": [stop], "ignore_eos": True}).json()
    assert s["choices"][0]["text"] == text[: text.index(stop)]
    assert s["choices"][0]["finish_reason"] == "stop" and s["choices"][0]["stop_reason"] == stop
    streamed, _ = stream_completion(url, {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "stop": [stop],
                                          "ignore_eos": True})
    assert streamed == s["choices"][0]["text"]

    # seeded sampling: same seed, same text; n > 1 with a seed: choice i uses seed + i
    sampled = {"prompt": prompts[0], "max_tokens": 8, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    a = httpx.post(f"{url}/v1/completions", json={**sampled, "n": 2}, headers=AUTH, timeout=60).json()
    b = httpx.post(f"{url}/v1/completions", json=sampled, headers=AUTH, timeout=60).json()
    c = httpx.post(f"{url}/v1/completions", json={**sampled, "seed": 8}, headers=AUTH, timeout=60).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["choices"][1]["text"] == c["choices"][0]["text"]

    # chat on the tiny model: template applied, logprobs as OpenAI shapes them
    chat = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=60, json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 4,
        "temperature": 0, "logprobs": True, "top_logprobs": 3, "ignore_eos": True}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(t["top_logprobs"]) == 3 for t in content)
    assert chat["usage"]["completion_tokens"] == 4


def _raw_http(port: int, request: bytes) -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < 10:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body[body.index(b"{"): body.rindex(b"}") + 1])


def test_errors_are_openai_shaped_and_harmless(tiny_server, offline):
    url = tiny_server.url
    prompt = random_prompts(1, seed=3)[0]
    want = offline.generate([prompt], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0].text

    # a stream in flight while the bad requests come in (read to its end afterwards)
    in_flight = httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, timeout=60, json={
        "prompt": prompt, "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stream": True})
    events = sse.events(sse.lines(in_flight.__enter__().iter_text()))
    got = [next(events)]

    comp, chat = f"{url}/v1/completions", f"{url}/v1/chat/completions"
    ok = {"prompt": "hi", "max_tokens": 2}
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ("post", comp, {**ok, "max_tokens": 0}, AUTH, 400, "max_tokens"),
        ("post", comp, {**ok, "max_tokens": -3}, AUTH, 400, "max_tokens"),
        ("post", comp, {**ok, "max_tokens": "many"}, AUTH, 400, "max_tokens"),
        ("post", comp, {**ok, "temperature": -0.5}, AUTH, 400, "temperature"),
        ("post", comp, {**ok, "temperature": 1e9}, AUTH, 400, "temperature"),
        ("post", comp, {**ok, "top_p": 0}, AUTH, 400, "top_p"),
        ("post", comp, {**ok, "top_k": 1 << 40}, AUTH, 400, "top_k"),
        ("post", comp, {**ok, "seed": 1 << 70}, AUTH, 400, "seed"),
        ("post", comp, {**ok, "n": 0}, AUTH, 400, "n"),
        ("post", comp, {**ok, "logprobs": 50}, AUTH, 400, "logprobs"),
        ("post", comp, {**ok, "model": "gpt-4"}, AUTH, 404, "model"),
        ("post", comp, {**ok, "prompt": [7] * 600}, AUTH, 400, "prompt"),
        ("post", comp, {**ok, "prompt": "word " * 600}, AUTH, 400, "prompt"),
        ("post", comp, {**ok, "prompt": [1 << 20]}, AUTH, 400, "prompt"),
        ("post", comp, {**ok, "prompt": []}, AUTH, 400, "prompt"),
        ("post", comp, {"max_tokens": 2}, AUTH, 400, "prompt"),
        ("post", chat, {"messages": []}, AUTH, 400, "messages"),
        ("post", chat, {"messages": [{"role": "", "content": "hi"}]}, AUTH, 400, "messages"),
        ("post", chat, {"messages": msgs, "top_logprobs": 2}, AUTH, 400, "top_logprobs"),
        ("post", chat, {"messages": msgs, "max_completion_tokens": 0}, AUTH, 400, "max_tokens"),
        ("post", comp, ok, {}, 401, None),
        ("post", comp, ok, {"Authorization": "Bearer wrong"}, 401, None),
        ("get", f"{url}/v1/models", None, {}, 401, None),
        ("get", f"{url}/v1/nothing-here", None, AUTH, 404, None),
        ("get", f"{url}/nothing-here", None, AUTH, 404, None),
    ]
    for method, where, body, headers, status, param in cases:
        r = httpx.request(method, where, json=body, headers=headers, timeout=30)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        assert err["param"] == param, (body, err)

    r = httpx.post(comp, content=b'{"prompt": "hi", "max_tokens":', headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]

    # bodies over the limit: declared (Content-Length), and found while reading (chunked)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {100 * MAX_BODY}\r\n\r\n").encode()
    status, body = _raw_http(tiny_server.port, head)
    assert status == 413 and body["error"]["type"] == "invalid_request_error"

    def chunks():
        yield b'{"prompt": "'
        for _ in range(3):
            yield b"a" * MAX_BODY
        yield b'"}'

    r = httpx.post(comp, content=chunks(), headers={**AUTH, "content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["message"]

    # still serving, and the stream in flight was not disturbed
    assert httpx.post(comp, json=ok, headers=AUTH, timeout=30).status_code == 200
    got += list(events)
    in_flight.__exit__(None, None, None)
    assert got[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in got[:-1]) == want


def test_absurd_parameters_are_refused_before_they_cost(tiny_server):
    """Parameters whose cost is out of proportion are refused up front, with a 400 naming them."""
    url, server = tiny_server.url, tiny_server.app.state.server
    comp, chat = f"{url}/v1/completions", f"{url}/v1/chat/completions"
    ok = {"prompt": "hi", "max_tokens": 2}
    deep: dict = {"type": "string"}
    for _ in range(100):  # 201 levels; ~25 s of xgrammar at 1,000
        deep = {"type": "object", "properties": {"a": deep}}
    tokenized: list[int] = []
    encode = server.tokenizer.encode
    server.tokenizer.encode = lambda text: tokenized.append(len(text)) or encode(text)
    too_long = "x" * (server.max_prompt_chars + 1)  # cannot fit 512 tokens, whatever the tokenizer does
    try:
        cases = [
            ({**ok, "stop": [f"s{i}" for i in range(65)]}, comp, "stop", "at most 64"),
            ({**ok, "stop": ["s" * 1025]}, comp, "stop", "1024 characters"),
            ({**ok, "stop_token_ids": list(range(1025))}, comp, "stop_token_ids", "at most 1024"),
            ({**ok, "stop_token_ids": [1 << 40]}, comp, "stop_token_ids", "32-bit"),
            ({**ok, "guided_json": deep}, comp, "guided_json", "deeper than 128"),
            ({**ok, "guided_choice": [str(i) for i in range(4097)]}, comp, "guided_choice", "at most 4096"),
            ({**ok, "prompt": too_long}, comp, "prompt", "characters"),
            ({**ok, "prompt": ["a", too_long]}, comp, "prompt", "characters"),
            ({**ok, "prompt": ["a"] * 1025}, comp, "prompt", "at most 1024"),
            ({"messages": [{"role": "user", "content": too_long}]}, chat, "prompt", "characters"),
        ]
        for body, where, param, words in cases:
            r = httpx.post(where, json=body, headers=AUTH, timeout=30)
            assert r.status_code == 400, (param, r.text)
            err = r.json()["error"]
            assert err["param"] == param and words in err["message"], err
        assert all(n < server.max_prompt_chars for n in tokenized)  # the long texts were never tokenized
    finally:
        server.tokenizer.encode = encode
    assert httpx.post(comp, json=ok, headers=AUTH, timeout=30).status_code == 200


def test_a_client_that_reads_slowly_does_not_stall_other_streams(tiny_server, offline):
    """A stream whose client stops reading (a tiny receive window, nothing read) holds only its own
    answer back: streams started after it finish with the right text, and the slow one, read at
    last, is complete too."""
    url = tiny_server.url
    big = {"prompt": random_prompts(1, seed=11)[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
           "n": 4, "logprobs": 20, "stream": True}  # ~6 MB of events: more than the socket buffers hold
    slow = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect(("127.0.0.1", tiny_server.port))
    payload = json.dumps(big).encode()
    slow.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload)
    try:
        wait_for_metrics(url, kvserve_num_requests_running=4.0)  # its four choices are being generated
        prompts = random_prompts(6, seed=12)
        want = [o.text for o in offline.generate(prompts, SamplingParams(max_tokens=60, temperature=0.0,
                                                                         ignore_eos=True))]

        async def fast(p: list[int]) -> str:
            async with httpx.AsyncClient(timeout=120) as client:
                body = {"prompt": p, "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
                async with client.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as r:
                    lines = [line async for line in sse.alines(r.aiter_text())]
            events = list(sse.events(lines))
            assert events[-1] == "[DONE]"
            return "".join(e["choices"][0]["text"] for e in events[:-1])

        async def run() -> list[str]:
            return await asyncio.gather(*(fast(p) for p in prompts))

        assert asyncio.run(run()) == want
        slow.settimeout(120)
        data = bytearray()
        while not data.endswith(b"data: [DONE]\r\n\r\n0\r\n\r\n") and not data.endswith(b"data: [DONE]\n\n"):
            chunk = slow.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    finally:
        slow.close()
    assert len(data) > 1 << 20 and b"data: [DONE]" in data
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    texts = ["", "", "", ""]
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            choice = json.loads(line[len(b"data: "):])["choices"][0]
            texts[choice["index"]] += choice["text"]
    want_big = offline.generate([big["prompt"]], SamplingParams(max_tokens=400, temperature=0.0,
                                                                ignore_eos=True))[0].text
    assert texts == [want_big] * 4


def test_logs_hold_no_prompt_text_unless_asked(tiny_server, caplog, capfd):
    """Every logger at DEBUG, requests that succeed, stream, fail and get refused: no prompt or
    answer text in any log line (this process's or the engine's stderr), until --log-requests."""
    url, server = tiny_server.url, tiny_server.app.state.server
    secret = "zebra-quartz-7731"
    comp, chat = f"{url}/v1/completions", f"{url}/v1/chat/completions"
    requests = [
        (comp, {"prompt": f"the code is {secret}", "max_tokens": 4}),
        (comp, {"prompt": f"{secret} again", "max_tokens": 4, "stream": True, "logprobs": 2}),
        (chat, {"messages": [{"role": "user", "content": secret}], "max_tokens": 4, "stream": True}),
        (chat, {"messages": [{"role": "user", "content": secret}], "max_tokens": 0}),
        (comp, {"prompt": secret, "guided_regex": f"({secret}"}),
        (comp, {"prompt": secret * 200, "max_tokens": 4}),
    ]
    with caplog.at_level(logging.DEBUG):
        for where, body in requests:
            httpx.post(where, json=body, headers=AUTH, timeout=30)
        wait_for_metrics(url, kvserve_num_requests_running=0.0)
    logged = caplog.text + "".join(capfd.readouterr())
    assert secret not in logged
    server.config.log_requests = True
    try:
        with caplog.at_level(logging.INFO):
            httpx.post(comp, json={"prompt": f"the code is {secret}", "max_tokens": 4}, headers=AUTH, timeout=30)
    finally:
        server.config.log_requests = False
    assert secret in caplog.text and "prompt tokens" in caplog.text


def test_aborted_streams_free_everything(tiny_server):
    url = tiny_server.url
    prompts = random_prompts(50, seed=4)

    async def open_and_drop(client: httpx.AsyncClient, p: list[int]) -> None:
        body = {"prompt": p, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break  # leaving the block closes the connection mid-stream

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as client:
            await asyncio.gather(*(open_and_drop(client, p) for p in prompts))

    before = metric(httpx.get(f"{url}/metrics").text, "kvserve_request_success_total", finished_reason="abort") \
        if "abort" in httpx.get(f"{url}/metrics").text else 0.0
    asyncio.run(run())
    text = wait_for_metrics(url, kvserve_num_requests_running=0.0, kvserve_num_requests_waiting=0.0,
                            kvserve_kv_cache_blocks_used=0.0)
    assert metric(text, "kvserve_kv_cache_usage_perc") == 0.0
    assert metric(text, "kvserve_request_success_total", finished_reason="abort") - before == 50
    assert tiny_server.client.num_in_flight == 0


def test_metrics_and_small_routes(tiny_server):
    url = tiny_server.url
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{url}/version").json()["version"]
    assert httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny"
    httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True}, headers=AUTH)
    text = httpx.get(f"{url}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_cache_blocks_used",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
                 "engine_handoff_seconds_count"):
        metric(text, f"kvserve_{name}")
    assert metric(text, "kvserve_request_success_total", finished_reason="length") >= 1
    assert metric(text, "kvserve_generation_tokens_total") >= 3
    # memory: the engine process's RSS from its snapshots, the API process's from prometheus_client
    assert metric(text, "kvserve_engine_resident_memory_bytes") > 1 << 20
    assert metric(text, "process_resident_memory_bytes") > 1 << 20


def test_prefix_cache_reports_cached_tokens(tiny_server):
    url = tiny_server.url
    prompt = list(range(100, 180))  # 80 tokens: five full blocks of 16
    body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True, "temperature": 0}
    first = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH).json()
    second = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH).json()
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 64  # the last block holds the last token
    text = httpx.get(f"{url}/metrics").text
    assert metric(text, "kvserve_prefix_cache_hits_by_tier_total", tier="device") >= 64
    assert metric(text, "kvserve_kv_cache_blocks_cached") >= 4


def test_speculative_decoding_usage_and_metrics(tiny_model_dir, offline):
    """A server drafting with a model loaded from a path (here the target itself, so every draft
    is accepted) answers greedy requests exactly as without speculation, reports drafted and
    accepted tokens in usage, and counts them in /metrics."""
    cfg = KVServeConfig.from_kwargs(model=str(tiny_model_dir), speculative_method="draft", speculative_model=str(tiny_model_dir),
                       adaptive_speculation=False, **TINY_ENGINE)
    prompt = list(range(200, 230))
    body = {"prompt": prompt, "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    want = offline.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    with ServerThread(AsyncEngineClient(cfg), ServerConfig(served_model_names=["tiny"])) as server:
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        _, events = stream_completion(server.url, {**body, "stream_options": {"include_usage": True}}, headers={})
        text = httpx.get(f"{server.url}/metrics").text
    assert r["choices"][0]["text"] == want.text
    u = r["usage"]
    spec = u["speculative"]
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] == spec["draft_tokens"]
    assert u["completion_tokens_details"]["accepted_prediction_tokens"] == spec["accepted_tokens"]
    assert u["completion_tokens_details"]["rejected_prediction_tokens"] == spec["draft_tokens"] - spec["accepted_tokens"]
    assert spec["mean_accepted_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["verify_steps"], abs=1e-3)
    assert events[-2]["usage"]["speculative"]["draft_tokens"] > 0
    drafted = metric(text, "kvserve_spec_decode_num_draft_tokens_total", method="draft")
    accepted = metric(text, "kvserve_spec_decode_num_accepted_tokens_total", method="draft")
    verifies = metric(text, "kvserve_spec_decode_num_drafts_total", method="draft")
    assert drafted >= 2 * spec["draft_tokens"] and accepted <= drafted
    assert metric(text, "kvserve_spec_decode_num_emitted_tokens_total", method="draft") == accepted + verifies
    assert metric(text, "kvserve_spec_decode_accepted_length_count", method="draft") == verifies


# --------------------------------------------------------------------------- kvserve serve, SIGTERM


def start_cli_server(model_dir, *flags: str) -> tuple[subprocess.Popen, str]:
    """`kvserve serve` on the tiny model in a subprocess, once /health answers: (process, url)."""
    return spawn_serve("--model", str(model_dir), "--dtype", "float32", "--num-threads", "1", "--num-kv-blocks",
                       "256", "--uvicorn-log-level", "warning", *flags)


def test_cli_serve_queue_limit_and_sigterm(tiny_model_dir):
    """`kvserve serve` in a subprocess: 429 when the waiting queue is full; SIGTERM lets the
    streams in flight finish and the process exit 0."""
    proc, url = start_cli_server(tiny_model_dir, "--max-num-seqs", "1", "--max-waiting-requests", "1")
    try:
        long_body = {"prompt": [5, 6, 7], "max_tokens": 500, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=long_body, timeout=60) as r:
            lines = sse.lines(r.iter_text())
            first = next(e for e in sse.events(lines))
            # a second request waits (one sequence at a time), a third finds the queue full
            waiting: dict = {}
            t = threading.Thread(target=lambda: waiting.update(r=httpx.post(
                f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)))
            t.start()
            wait_for_metrics(url, kvserve_num_requests_waiting=1.0)
            busy = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=10)
            assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_error"

            proc.send_signal(signal.SIGTERM)
            rest = list(sse.events(lines))
        assert rest[-1] == "[DONE]"
        chunks = [first, *rest[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        t.join(60)
        assert waiting["r"].status_code == 200 and waiting["r"].json()["usage"]["completion_tokens"] == 4
        assert proc.wait(60) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sse_events_survive_clients_that_split_on_unicode_line_breaks():
    """A sampled token can be U+2028 or NEL; JSON may carry them raw, and clients that split lines
    like str.splitlines (httpx's aiter_lines) would cut the event: the server escapes them."""
    from kvserve.server import protocol as P
    from kvserve.server.streaming import sse_event as _sse

    text = "a\u2028b\u2029c\x85d"
    event = _sse(P.CompletionResponse(id="x", created=0, model="m",
                                      choices=[P.CompletionChoice(index=0, text=text, finish_reason=None)]))
    lines = [line for line in event.splitlines() if line]
    assert len(lines) == 1 and json.loads(lines[0][len("data: "):])["choices"][0]["text"] == text


def test_cli_serve_exits_non_zero_when_the_engine_dies(tiny_model_dir):
    """The engine process killed under `kvserve serve`: the server exits non-zero by itself (so a
    supervisor restarts it) instead of serving 503s forever. (What requests in flight see is
    tested in test_engine_process.py: an EngineDeadError, not a hang.)"""
    proc, _ = start_cli_server(tiny_model_dir)
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        engine_pid = next(int(c) for c in children  # not multiprocessing's resource tracker
                          if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes())
        os.kill(engine_pid, signal.SIGKILL)
        code = proc.wait(60)
        out = proc.stdout.read()
        assert code != 0 and "engine process died" in out, (code, out[-500:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
