"""Soak: mixed traffic against a server for a set time, then the books are checked.

``concurrency`` clients each send one request after another until ``duration`` runs out, every
request drawn at random from a mix: completions and chat, streamed and not; clients that close
the connection mid-stream or before the first token; JSON-schema constrained answers (validated
with jsonschema when they finish with ``stop``); prompts that share a few long prefixes (the
prefix cache); n > 1, seeded sampling, stop strings, logprobs; and a few deliberately bad
requests, whose 400s are expected errors. Every response is checked: status, a well-formed body
or an event stream that ends with ``[DONE]``, finish reasons, usage. Anything else (a 5xx, a
malformed answer, a timeout, a broken connection) is an unexplained error.

Every ``sample_interval`` seconds /metrics gives the server's and the engine's RSS, the running
and waiting requests and the KV blocks in use and cached. At the end traffic stops, the server is
left to go idle, and the KV blocks still in use are leaked ones (``kvserve:kv_cache_blocks_used``
counts blocks held by requests; blocks only the prefix cache holds count as free).

    python scripts/soak.py --model PATH --duration 120 --serve-args "--num-kv-blocks 64" --json-out soak.json
    python scripts/soak.py --url http://127.0.0.1:8000 --duration 1200 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvserve.bench import prometheus, sse
from kvserve.bench.stats import Dist

# kind: weight in the mix
MIX: dict[str, float] = {
    "completion": 3, "completion_stream": 3, "chat": 3, "chat_stream": 3, "json": 2,
    "abort_mid_stream": 1.5, "abort_early": 1.5, "bad": 0.5,
}
ABORT_KINDS = ("abort_mid_stream", "abort_early")

SCHEMAS = [
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tier": {"enum": ["free", "pro", "enterprise"]},
        "paid": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "tier", "paid", "count"], "additionalProperties": False},
]
WORDS = ("the cache server token block prefix model answer request engine stream batch memory "
         "page queue river mountain orange violet quiet rapid simple careful history number letter "
         "garden window market silver winter summer table").split()
STOPS = [["\n"], ["."], [" a"], ["e", "x"]]
_METRICS = {
    "server_rss": "process_resident_memory_bytes", "engine_rss": "kvserve:engine_resident_memory_bytes",
    "running": "kvserve:num_requests_running", "waiting": "kvserve:num_requests_waiting",
    "kv_used": "kvserve:kv_cache_blocks_used", "kv_cached": "kvserve:kv_cache_blocks_cached",
    "kv_total": "kvserve:kv_cache_blocks_total", "preemptions": "kvserve:num_preemptions_total",
    "generation_tokens": "kvserve:generation_tokens_total",
}


class Unexpected(Exception):
    """A response that breaks the contract: wrong status, malformed body or stream, bad usage."""


@dataclass
class SoakConfig:
    url: str
    duration: float = 60.0
    concurrency: int = 8
    seed: int = 0
    sample_interval: float = 2.0
    warmup: float | None = None  # seconds; default: the first 25% of the duration
    max_tokens: int = 64  # largest max_tokens of an ordinary request
    num_prefixes: int = 4
    prefix_words: int = 120
    request_timeout: float = 120.0
    idle_timeout: float = 60.0
    mix: dict[str, float] = field(default_factory=lambda: dict(MIX))


@dataclass
class Outcome:
    kind: str
    result: str  # ok | aborted | expected_error | unexplained
    detail: str | None = None
    start: float = 0.0
    ttft: float | None = None
    latency: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    json_valid: int = 0  # constrained choices that ended with "stop" and validated against their schema


# --------------------------------------------------------------------------- the traffic


@dataclass
class Plan:
    kind: str
    path: str
    body: Any  # a dict sent as JSON, or bytes sent as they are
    stream: bool = False
    expect_status: int = 200
    abort_after_events: int | None = None
    abort_after_s: float | None = None
    schema: Any = None
    stop: list[str] | None = None
    all_length: bool = False  # every choice must end with "length" (ignore_eos, no stop, no grammar)
    max_tokens: int = 16
    num_prompts: int = 1
    n: int = 1
    include_usage: bool = False


class Traffic:
    """Draws requests: one random generator per client, so a seed gives the same mix."""

    def __init__(self, cfg: SoakConfig, model: str, max_model_len: int):
        self.cfg, self.model, self.max_model_len = cfg, model, max_model_len
        rng = random.Random(cfg.seed)
        words = min(cfg.prefix_words, max(8, max_model_len // 5))  # prompts stay well inside the context
        self.prefixes = [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(cfg.num_prefixes)]
        self.kinds = list(cfg.mix)
        self.weights = [cfg.mix[k] for k in self.kinds]
        # room for a prompt of prefix_words words (~1.5 tokens each) and the chat template
        self.max_tokens = max(1, min(cfg.max_tokens, (max_model_len - 2 * words - 64) // 2))
        self.words = words

    def _text(self, rng: random.Random, shared: bool, with_prefix: bool = True) -> str:
        """A short question after a shared prefix, or a prompt of its own of any length up to a prefix's."""
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30 if shared else self.words)))
        return f"{rng.choice(self.prefixes)}\n\n{words}" if shared and with_prefix else words

    def _sampling(self, rng: random.Random, body: dict, plan: Plan, *, long: bool = False) -> None:
        plan.max_tokens = body["max_tokens"] = rng.randint(max(1, self.max_tokens // 2) if long else 1,
                                                           self.max_tokens * (3 if long else 1))
        r = rng.random()
        if r < 0.3:
            body["temperature"] = 0.0
        elif r < 0.7:
            body["temperature"], body["seed"] = rng.choice([0.7, 1.0]), rng.randrange(1 << 31)
        else:
            body["temperature"], body["top_p"] = 0.9, 0.95
        if rng.random() < 0.2:
            plan.n = body["n"] = rng.randint(2, 3)
        if not long and rng.random() < 0.2:
            plan.stop = body["stop"] = rng.choice(STOPS)
        body["ignore_eos"] = long or rng.random() < 0.5
        plan.all_length = body["ignore_eos"] and plan.stop is None and plan.schema is None

    def draw(self, rng: random.Random) -> Plan:
        kind = rng.choices(self.kinds, self.weights)[0]
        if kind == "bad":
            return self._bad(rng)
        chat = kind.startswith("chat") or kind == "json" or (kind in ABORT_KINDS and rng.random() < 0.5)
        stream = kind.endswith("_stream") or kind == "abort_mid_stream" or (
            kind in ("json", "abort_early") and rng.random() < 0.5)
        plan = Plan(kind, "/v1/chat/completions" if chat else "/v1/completions", None, stream=stream)
        body: dict[str, Any] = {"model": self.model, "stream": stream}
        shared = rng.random() < 0.7
        if kind == "json":
            plan.schema = rng.choice(SCHEMAS)
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer",
                                                                              "schema": plan.schema}}
        if chat:
            body["messages"] = ([{"role": "system", "content": rng.choice(self.prefixes)}] if shared else []) + [
                {"role": "user", "content": self._text(rng, shared, with_prefix=False)}]
        elif rng.random() < 0.1:
            plan.num_prompts = 2
            body["prompt"] = [self._text(rng, shared), self._text(rng, shared)]
        elif rng.random() < 0.1:
            body["prompt"] = [rng.randrange(3, 200) for _ in range(rng.randint(1, 40))]
        else:
            body["prompt"] = self._text(rng, shared)
        self._sampling(rng, body, plan, long=kind in ABORT_KINDS)
        if kind == "json":
            body["max_tokens"] = plan.max_tokens = max(plan.max_tokens, min(self.max_tokens * 2, 96))
        if rng.random() < 0.15 and kind != "json":
            if chat:
                body["logprobs"], body["top_logprobs"] = True, 2
            else:
                body["logprobs"] = 2
        if stream and rng.random() < 0.7:
            plan.include_usage = True
            body["stream_options"] = {"include_usage": True}
        if kind == "abort_mid_stream":
            plan.abort_after_events = rng.randint(1, 4)
        elif kind == "abort_early":
            plan.abort_after_s = rng.uniform(0.0, 0.05)
        plan.body = body
        return plan

    def _bad(self, rng: random.Random) -> Plan:
        """A request the server must refuse with a 400 and an OpenAI error body."""
        msgs = [{"role": "user", "content": "hello"}]
        chat = "/v1/chat/completions"
        cases: list[tuple[str, Any]] = [
            (chat, {"model": "no-such-model", "messages": msgs}),
            (chat, {"model": self.model, "messages": []}),
            (chat, {"model": self.model, "messages": msgs, "temperature": -1}),
            (chat, {"model": self.model, "messages": msgs, "n": 0}),
            (chat, {"model": self.model, "messages": msgs, "top_logprobs": 2}),
            (chat, {"model": self.model, "messages": msgs, "response_format": {"type": "json_schema",
                                                                               "json_schema": {"name": "x"}}}),
            ("/v1/completions", {"model": self.model, "prompt": "hi", "max_tokens": 0}),
            ("/v1/completions", {"model": self.model, "prompt": "hello " * (2 * self.max_model_len)}),
            ("/v1/completions", b'{"prompt": "hi", "max_tokens": '),
        ]
        path, body = rng.choice(cases)
        return Plan("bad", path, body, stream=bool(isinstance(body, dict) and rng.random() < 0.5),
                    expect_status=400)


# --------------------------------------------------------------------------- checking one request


def _check_usage(plan: Plan, usage: Any, finishes: dict[int, str], max_model_len: int) -> tuple[int, int, int]:
    if not isinstance(usage, dict):
        raise Unexpected(f"usage is {usage!r}")
    p, c, t = usage.get("prompt_tokens"), usage.get("completion_tokens"), usage.get("total_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if not all(isinstance(v, int) for v in (p, c, t, cached)) or p < 1 or c < 0 or t != p + c:
        raise Unexpected(f"inconsistent usage {usage}")
    if not 0 <= cached <= p:
        raise Unexpected(f"cached_tokens {cached} of {p} prompt tokens")
    choices = plan.num_prompts * plan.n
    if c > choices * plan.max_tokens or c < len(finishes) - sum(f == "stop" for f in finishes.values()):
        raise Unexpected(f"{c} completion tokens for {choices} choices of max_tokens {plan.max_tokens} ({finishes})")
    if plan.all_length and plan.num_prompts == 1:
        want = plan.n * min(plan.max_tokens, max_model_len - p)
        if c != want:
            raise Unexpected(f"all choices ended by length but completion_tokens is {c}, not {want}")
    return p, c, cached


def _check_choice_ends(plan: Plan, finishes: dict[int, str], texts: dict[int, str],
                       stop_reasons: dict[int, Any]) -> int:
    """Check how each choice ended; the number of JSON answers validated."""
    valid = 0
    want = set(range(plan.num_prompts * plan.n))
    if set(finishes) != want:
        raise Unexpected(f"choices {sorted(finishes)} finished, expected {sorted(want)}")
    for i, f in finishes.items():
        if f not in ("stop", "length") or (plan.all_length and f != "length"):
            raise Unexpected(f"choice {i} finished with {f!r}")
        if plan.stop and any(s in texts.get(i, "") for s in plan.stop):
            raise Unexpected(f"choice {i} text contains a stop string {plan.stop}: {texts[i][-80:]!r}")
        by_string = isinstance(stop_reasons.get(i), str)
        if by_string and (f != "stop" or stop_reasons[i] not in (plan.stop or ())):
            raise Unexpected(f"choice {i} ended with {f!r} by the stop string {stop_reasons[i]!r}, not one of "
                             f"{plan.stop}")
        if plan.schema is not None and f == "stop" and not by_string:  # a stop string may cut the JSON short
            import jsonschema

            try:
                jsonschema.validate(json.loads(texts.get(i, "")), plan.schema)
            except (ValueError, jsonschema.ValidationError) as e:
                raise Unexpected(f"choice {i} is not valid JSON for its schema: {texts.get(i)!r} "
                                 f"({type(e).__name__}; stop_reason {stop_reasons.get(i)!r})") from None
            valid += 1
    return valid


def _check_error_body(body: Any) -> None:
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str) or not isinstance(err.get("type"), str):
        raise Unexpected(f"not an OpenAI error body: {str(body)[:200]}")


class Checker:
    """Sends one planned request and checks everything that comes back."""

    def __init__(self, client: Any, base: str, max_model_len: int, t0: float):
        self.client, self.base, self.max_model_len, self.t0 = client, base, max_model_len, t0

    async def run(self, plan: Plan) -> Outcome:
        import httpx

        out = Outcome(plan.kind, "ok", start=time.perf_counter() - self.t0)
        start = time.perf_counter()
        try:
            if plan.abort_after_s is not None:
                try:
                    await asyncio.wait_for(self._send(plan, out, start), plan.abort_after_s)
                except TimeoutError:
                    out.result = "aborted"
            else:
                await self._send(plan, out, start)
        except Unexpected as e:
            out.result, out.detail = "unexplained", str(e)[:500]
        except httpx.TimeoutException as e:
            out.result, out.detail = "unexplained", f"timeout ({type(e).__name__})"
        except Exception as e:  # noqa: BLE001 - broken connection, bad JSON, a body of the wrong shape
            out.result, out.detail = "unexplained", f"{type(e).__name__}: {e}"[:500]
        return out

    async def _send(self, plan: Plan, out: Outcome, start: float) -> None:
        kwargs = {"json": plan.body} if isinstance(plan.body, dict) else {
            "content": plan.body, "headers": {"content-type": "application/json"}}
        async with self.client.stream("POST", self.base + plan.path, **kwargs) as resp:
            if resp.status_code != 200 or plan.expect_status != 200:
                body = await resp.aread()
                if resp.status_code not in (plan.expect_status, 429):  # 429: the waiting queue is full
                    raise Unexpected(f"HTTP {resp.status_code} (expected {plan.expect_status}): {body[:300]!r}")
                try:
                    _check_error_body(json.loads(body))
                except ValueError:
                    raise Unexpected(f"HTTP {resp.status_code}, body not JSON: {body[:200]!r}") from None
                out.result, out.detail = "expected_error", "429 busy" if resp.status_code == 429 else None
                return
            if plan.stream:
                await self._read_stream(plan, resp, out, start)
            else:
                self._check_body(plan, json.loads(await resp.aread()), out)
                out.latency = time.perf_counter() - start

    def _check_body(self, plan: Plan, body: dict, out: Outcome) -> None:
        chat = plan.path.endswith("chat/completions")
        if body.get("object") != ("chat.completion" if chat else "text_completion"):
            raise Unexpected(f"object is {body.get('object')!r}")
        finishes: dict[int, str] = {}
        texts: dict[int, str] = {}
        stop_reasons: dict[int, Any] = {}
        for ch in body["choices"]:
            i = ch["index"]
            if i in finishes:
                raise Unexpected(f"choice {i} twice")
            finishes[i], stop_reasons[i] = ch["finish_reason"], ch.get("stop_reason")
            if chat:
                if ch["message"]["role"] != "assistant":
                    raise Unexpected(f"message role {ch['message']['role']!r}")
                texts[i] = ch["message"]["content"] or ""
            else:
                texts[i] = ch["text"]
            if not isinstance(texts[i], str):
                raise Unexpected(f"choice {i} text is {texts[i]!r}")
            if plan.body.get("logprobs") and ch.get("logprobs") is None:
                raise Unexpected(f"choice {i} has no logprobs")
        out.json_valid = _check_choice_ends(plan, finishes, texts, stop_reasons)
        out.prompt_tokens, out.completion_tokens, out.cached_tokens = _check_usage(
            plan, body.get("usage"), finishes, self.max_model_len)

    async def _read_stream(self, plan: Plan, resp: Any, out: Outcome, start: float) -> None:
        chat = plan.path.endswith("chat/completions")
        if not resp.headers.get("content-type", "").startswith("text/event-stream"):
            raise Unexpected(f"stream with content-type {resp.headers.get('content-type')!r}")
        want_object = "chat.completion.chunk" if chat else "text_completion"
        finishes: dict[int, str] = {}
        stop_reasons: dict[int, Any] = {}
        texts: dict[int, str] = {}
        usage: Any = None
        events = text_chunks = 0
        done = False
        async for line in sse.alines(resp.aiter_text()):
            data = sse.payload(line)
            if data is None:
                if line and not line.startswith(":"):
                    raise Unexpected(f"not an SSE data line: {line[:200]!r}")
                continue
            if done:
                raise Unexpected(f"data after [DONE]: {line[:200]!r}")
            if data == sse.DONE:
                done = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                raise Unexpected(f"error event in the stream: {str(chunk['error'])[:300]}")
            if chunk.get("object") != want_object:
                raise Unexpected(f"chunk object {chunk.get('object')!r}")
            events += 1
            if usage is not None:
                raise Unexpected("a chunk after the usage chunk")
            if chunk.get("usage") is not None:
                if chunk["choices"]:
                    raise Unexpected("the usage chunk has choices")
                usage = chunk["usage"]
            for ch in chunk["choices"]:
                i = ch["index"]
                text = (ch["delta"].get("content") if chat else ch["text"]) or ""
                if i in finishes and (text or ch.get("finish_reason")):
                    raise Unexpected(f"choice {i} got more after it finished")
                if text:
                    texts[i] = texts.get(i, "") + text
                    text_chunks += 1
                    if out.ttft is None:
                        out.ttft = time.perf_counter() - start
                if ch.get("finish_reason") is not None:
                    finishes[i], stop_reasons[i] = ch["finish_reason"], ch.get("stop_reason")
            if plan.abort_after_events is not None and events >= plan.abort_after_events:
                out.result = "aborted"
                return  # leaving the block closes the connection mid-stream
        if not done:
            raise Unexpected(f"the stream ended without [DONE] after {events} events")
        out.latency = time.perf_counter() - start
        out.json_valid = _check_choice_ends(plan, finishes, texts, stop_reasons)
        if plan.include_usage:
            if usage is None:
                raise Unexpected("include_usage but no usage chunk")
            out.prompt_tokens, out.completion_tokens, out.cached_tokens = _check_usage(
                plan, usage, finishes, self.max_model_len)
            # a chunk carries at least one new token, or text held back until the choice ended
            if text_chunks > out.completion_tokens + len(finishes):
                raise Unexpected(f"{text_chunks} text chunks for {out.completion_tokens} tokens")
        elif usage is not None:
            raise Unexpected("a usage chunk nobody asked for")


# --------------------------------------------------------------------------- /metrics


async def sample(client: Any, base: str, t: float) -> dict[str, float | None]:
    got = prometheus.totals((await client.get(base + "/metrics", timeout=30)).text)
    return {"t": round(t, 2), **{k: got.get(name) for k, name in _METRICS.items()}}


# --------------------------------------------------------------------------- the run


def _dist(values: list[float]) -> dict | None:
    d = Dist.of(values)
    return asdict(d) if d else None


def _series_stats(samples: list[dict], key: str, warmup: float) -> dict | None:
    pts = [(s["t"], s[key]) for s in samples if s.get(key) is not None]
    if not pts:
        return None
    after = [p for p in pts if p[0] >= warmup] or pts[-1:]
    mib = 1 << 20
    slope = None
    if len(after) >= 3 and after[-1][0] > after[0][0]:  # least squares, MiB per minute
        mt = sum(t for t, _ in after) / len(after)
        mv = sum(v for _, v in after) / len(after)
        den = sum((t - mt) ** 2 for t, _ in after)
        slope = round(sum((t - mt) * (v - mv) for t, v in after) / den * 60 / mib, 3) if den else None
    return {"first_mib": round(pts[0][1] / mib, 1), "after_warmup_mib": round(after[0][1] / mib, 1),
            "max_mib": round(max(v for _, v in pts) / mib, 1), "last_mib": round(pts[-1][1] / mib, 1),
            "growth_after_warmup_mib": round((pts[-1][1] - after[0][1]) / mib, 1),
            "slope_after_warmup_mib_per_min": slope}


async def run_soak(cfg: SoakConfig, *, progress: bool = True) -> dict:
    """Run the soak against ``cfg.url``; the full result (see ``format_result``)."""
    import httpx

    base = cfg.url.rstrip("/")
    warmup = cfg.warmup if cfg.warmup is not None else cfg.duration / 4
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout, connect=10.0),
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)) as client:
        card = (await client.get(base + "/v1/models")).json()["data"][0]
        model, max_model_len = card["id"], card.get("max_model_len") or 2048
        traffic = Traffic(cfg, model, max_model_len)
        outcomes: list[Outcome] = []
        samples: list[dict] = []
        monitor_errors: list[str] = []
        t0 = time.perf_counter()
        deadline = t0 + cfg.duration
        checker = Checker(client, base, max_model_len, t0)

        async def worker(i: int) -> None:
            rng = random.Random(f"{cfg.seed}-{i}")
            while time.perf_counter() < deadline:
                outcomes.append(await checker.run(traffic.draw(rng)))
                if outcomes[-1].detail == "429 busy":  # back off, as a client should
                    await asyncio.sleep(rng.uniform(0.1, 0.5))

        async def sampler(stop: asyncio.Event) -> None:
            last_print = 0.0
            while not stop.is_set():
                try:
                    samples.append(await sample(client, base, time.perf_counter() - t0))
                except Exception as e:  # noqa: BLE001 - the server did not answer /metrics: an error
                    monitor_errors.append(f"/metrics: {type(e).__name__}: {e}"[:300])
                if progress and time.perf_counter() - last_print >= 10 and samples:
                    last_print = time.perf_counter()
                    s = samples[-1]
                    bad = sum(o.result == "unexplained" for o in outcomes)
                    print(f"[soak {s['t']:6.0f}s] requests {len(outcomes)}, unexplained {bad}, running "
                          f"{s['running']}, waiting {s['waiting']}, KV used {s['kv_used']}, server RSS "
                          f"{(s['server_rss'] or 0) / 2**20:.0f} MiB, engine RSS {(s['engine_rss'] or 0) / 2**20:.0f}"
                          " MiB", file=sys.stderr, flush=True)
                try:
                    await asyncio.wait_for(stop.wait(), cfg.sample_interval)
                except TimeoutError:
                    pass

        stop = asyncio.Event()
        sampling = asyncio.ensure_future(sampler(stop))
        await asyncio.gather(*(worker(i) for i in range(cfg.concurrency)))
        traffic_s = time.perf_counter() - t0
        stop.set()
        await sampling

        # traffic stopped: the server must go idle and give every block back
        idle_deadline = time.perf_counter() + cfg.idle_timeout
        final: dict[str, Any] = {}
        while True:
            try:
                final = await sample(client, base, time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001
                monitor_errors.append(f"/metrics after traffic: {type(e).__name__}: {e}"[:300])
            idle = final.get("running") == 0 and final.get("waiting") == 0 and final.get("kv_used") == 0
            if idle or time.perf_counter() > idle_deadline:
                break
            await asyncio.sleep(0.2)
        if final:
            samples.append(final)
        try:
            healthy = (await client.get(base + "/health", timeout=10)).status_code == 200
        except httpx.HTTPError:
            healthy = False

    return _result(cfg, outcomes, samples, final, monitor_errors, healthy, traffic_s, warmup, model)


def _result(cfg: SoakConfig, outcomes: list[Outcome], samples: list[dict], final: dict, monitor_errors: list[str],
            healthy: bool, traffic_s: float, warmup: float, model: str) -> dict:
    by_kind: dict[str, dict[str, int]] = {}
    for o in outcomes:
        k = by_kind.setdefault(o.kind, {"ok": 0, "aborted": 0, "expected_error": 0, "unexplained": 0})
        k[o.result] += 1
    served = [o for o in outcomes if o.result == "ok"]
    unexplained = [o for o in outcomes if o.result == "unexplained"]
    examples: dict[str, int] = {}
    for o in unexplained:
        key = f"{o.kind}: {o.detail}"
        examples[key] = examples.get(key, 0) + 1
    leaked = None
    if final.get("kv_used") is not None and final.get("running") == 0 and final.get("waiting") == 0:
        leaked = int(final["kv_used"])
    gen = [s["generation_tokens"] for s in samples if s.get("generation_tokens") is not None]
    prompt_tokens = sum(o.prompt_tokens for o in served)
    return {
        "config": asdict(cfg), "model": model, "traffic_s": round(traffic_s, 1), "warmup_s": warmup,
        "requests": len(outcomes),
        "served": sum(k["ok"] + k["aborted"] for k in by_kind.values()),
        "by_kind": dict(sorted(by_kind.items())),
        "expected_errors": sum(o.result == "expected_error" for o in outcomes),
        "busy_429": sum(o.detail == "429 busy" for o in outcomes),
        "json_answers_validated": sum(o.json_valid for o in outcomes),
        "unexplained_errors": len(unexplained) + len(monitor_errors),
        "unexplained_examples": dict(sorted(examples.items(), key=lambda kv: -kv[1])[:20]),
        "monitor_errors": monitor_errors[:20],
        "ttft_ms": _dist([o.ttft for o in served if o.ttft is not None]),
        "e2e_ms": _dist([o.latency for o in served if o.latency is not None]),
        "ttft_ms_by_kind": {k: _dist([o.ttft for o in served if o.kind == k and o.ttft is not None])
                            for k in by_kind if any(o.kind == k and o.ttft is not None for o in served)},
        "e2e_ms_by_kind": {k: _dist([o.latency for o in served if o.kind == k and o.latency is not None])
                           for k in by_kind if any(o.kind == k and o.latency is not None for o in served)},
        "output_tokens": sum(o.completion_tokens for o in served),
        "output_tokens_per_s": round(sum(o.completion_tokens for o in served) / max(traffic_s, 1e-9), 1),
        "server_generation_tokens_per_s": round((gen[-1] - gen[0]) / max(traffic_s, 1e-9), 1) if len(gen) > 1 else None,
        "prompt_tokens": prompt_tokens,
        "prefix_cache_hit_rate": round(sum(o.cached_tokens for o in served) / max(1, prompt_tokens), 4),
        "preemptions": (final.get("preemptions") or 0) - (samples[0].get("preemptions") or 0) if samples else None,
        "server_rss": _series_stats(samples, "server_rss", warmup),
        "engine_rss": _series_stats(samples, "engine_rss", warmup),
        "idle": final,
        "leaked_blocks": leaked,
        "healthy_at_end": healthy,
        "samples": samples,
    }


def failed(result: dict) -> list[str]:
    """Why the soak failed (empty: it passed)."""
    why = []
    if result["unexplained_errors"]:
        why.append(f"{result['unexplained_errors']} unexplained errors")
    if result["leaked_blocks"] is None:
        why.append("the server did not go idle after the traffic stopped")
    elif result["leaked_blocks"]:
        why.append(f"{result['leaked_blocks']} KV blocks leaked")
    if not result["healthy_at_end"]:
        why.append("/health did not answer 200 at the end")
    if result.get("server_log_errors"):
        why.append(f"{len(result['server_log_errors'])} errors in the server's log")
    if result.get("server_exit_code") not in (None, 0):
        why.append(f"the server exited with status {result['server_exit_code']}")
    return why


def format_result(r: dict) -> str:
    def dist(d: dict | None) -> str:
        return "-" if d is None else f"p50 {d['p50']:.0f}, p99 {d['p99']:.0f}"

    def rss(d: dict | None) -> str:
        if d is None:
            return "-"
        return (f"first {d['first_mib']}, after warm-up {d['after_warmup_mib']}, max {d['max_mib']}, "
                f"last {d['last_mib']} MiB; growth after warm-up {d['growth_after_warmup_mib']:+} MiB "
                f"({d['slope_after_warmup_mib_per_min']} MiB/min)")

    lines = [f"soak: {r['traffic_s']} s of traffic on {r['model']}, {r['config']['concurrency']} clients",
             f"requests {r['requests']}, served {r['served']} (aborts included), expected errors "
             f"{r['expected_errors']} (429s {r['busy_429']}), UNEXPLAINED {r['unexplained_errors']}"]
    for kind, k in r["by_kind"].items():
        lines.append(f"  {kind:<18} ok {k['ok']:>6}  aborted {k['aborted']:>5}  expected errors "
                     f"{k['expected_error']:>4}  unexplained {k['unexplained']:>3}")
    for example, n in r["unexplained_examples"].items():
        lines.append(f"  ! {n} x {example}")
    for e in r["monitor_errors"]:
        lines.append(f"  ! {e}")
    for e in r.get("server_log_errors", [])[:10]:
        lines.append(f"  ! server log: {e}")
    lines += [
        f"TTFT ms {dist(r['ttft_ms'])}; end-to-end ms {dist(r['e2e_ms'])}",
        f"output tokens {r['output_tokens']} ({r['output_tokens_per_s']}/s; the server counted "
        f"{r['server_generation_tokens_per_s']}/s), JSON answers validated {r['json_answers_validated']}, "
        f"prefix cache hits {r['prefix_cache_hit_rate']:.1%} of prompt "
        f"tokens, preemptions {r['preemptions']}",
        f"server RSS: {rss(r['server_rss'])}",
        f"engine RSS: {rss(r['engine_rss'])}",
        f"leaked KV blocks once idle: {r['leaked_blocks']} (cached: {r['idle'].get('kv_cached')}); "
        f"healthy at the end: {r['healthy_at_end']}",
    ]
    why = failed(r)
    lines.append("FAILED: " + "; ".join(why) if why else "PASSED")
    return "\n".join(lines)


# --------------------------------------------------------------------------- a server of its own


_LOG_ERROR = re.compile(r"Traceback|(^|\s)(ERROR|CRITICAL)[:\s]")


class ServeProcess:
    """``kvserve serve --model PATH`` in a subprocess on a free port, its output in a log file."""

    def __init__(self, model: str, serve_args: list[str], log_path: str | None = None, startup_timeout: float = 300):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model, self.serve_args, self.startup_timeout = model, serve_args, startup_timeout
        self.log_path = log_path or tempfile.mkstemp(prefix="kvserve-soak-", suffix=".log")[1]
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None

    def __enter__(self) -> ServeProcess:
        import httpx

        import kvserve

        here = str(Path(kvserve.__file__).resolve().parents[1])  # the server runs this same kvserve
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
        model = [] if self.model == "embedded" else ["--model", self.model]
        cmd = [sys.executable, "-m", "kvserve", "serve", *model, "--port", str(self.port),
               "--uvicorn-log-level", "warning", *self.serve_args]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvserve serve exited with status {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvserve serve did not come up in {self.startup_timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.3)

    def stop(self) -> int | None:
        if self.proc is not None and self.exit_code is None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(60)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.exit_code = self.proc.returncode
            self._log.close()
        return self.exit_code

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def log_errors(self) -> list[str]:
        """Lines of the server's log that say something went wrong (tracebacks, ERROR lines)."""
        try:
            lines = Path(self.log_path).read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [line[:300] for line in lines if _LOG_ERROR.search(line)]


def soak_with_server(cfg: SoakConfig, model: str, serve_args: list[str], log_path: str | None = None,
                     progress: bool = True) -> dict:
    """Start ``kvserve serve`` on ``model``, soak it, stop it (SIGTERM) and add what its log and exit say."""
    with ServeProcess(model, serve_args, log_path) as server:
        cfg.url = server.url
        result = asyncio.run(run_soak(cfg, progress=progress))
        result["server_alive_at_end"] = server.alive
        result["server_exit_code"] = server.stop()
    result["server_log"] = server.log_path
    result["server_log_errors"] = server.log_errors()
    return result


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server")
    where.add_argument("--model", help="start `kvserve serve --model MODEL` (embedded: the default model)")
    ap.add_argument("--serve-args", default="", help="more flags for kvserve serve, e.g. \"--num-kv-blocks 64\"")
    ap.add_argument("--server-log", default=None, help="the started server's log (default: a temporary file)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    ap.add_argument("--concurrency", type=int, default=8, help="clients, each one request at a time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-interval", type=float, default=2.0, help="seconds between /metrics samples")
    ap.add_argument("--warmup", type=float, default=None, help="seconds of warm-up before RSS growth is measured "
                                                                 "(default: a quarter of --duration)")
    ap.add_argument("--max-tokens", type=int, default=64, help="largest max_tokens of ordinary requests (aborted "
                                                                 "streams ask for up to 3x)")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="a request slower than this is an error")
    ap.add_argument("--json-out", default=None, help="write the full result (RSS series included) here")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    cfg = SoakConfig(url=a.url or "", duration=a.duration, concurrency=a.concurrency, seed=a.seed,
                     sample_interval=a.sample_interval, warmup=a.warmup, max_tokens=a.max_tokens,
                     request_timeout=a.request_timeout)
    if a.model:
        result = soak_with_server(cfg, a.model, shlex.split(a.serve_args), a.server_log, progress=not a.quiet)
    else:
        result = asyncio.run(run_soak(cfg, progress=not a.quiet))
    print(format_result(result))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 1 if failed(result) else 0


if __name__ == "__main__":
    sys.exit(main())
