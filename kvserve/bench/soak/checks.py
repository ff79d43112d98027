"""The soak's answer checker: sends one planned request and checks status, body or stream, finish reasons, usage."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from kvserve.bench import sse
from kvserve.bench.soak.traffic import Plan


class Unexpected(Exception):
    """A response that breaks the contract: wrong status, malformed body or stream, bad usage."""



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
