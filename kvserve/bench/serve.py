"""``kvserve bench serve``: load any OpenAI-compatible server with streaming completions.

The first cut of the serving benchmark: the ``random`` dataset (fixed input and output
lengths, token-id prompts, ignore_eos), all at once (``--request-rate inf``) or Poisson,
bounded by ``--max-concurrency``. It reports throughput, TTFT, ITL, TPOT and end-to-end
latency percentiles, and counts errors instead of stopping on them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

from kvserve.bench.offline import percentile


@dataclass
class RequestRecord:
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--dataset", default="random", choices=["random"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-low", type=int, default=100)
    p.add_argument("--vocab-high", type=int, default=40000)
    p.add_argument("--text-prompts", action="store_true", help="send text instead of token ids")
    p.add_argument("--save-result", default=None, help="write the summary and per-request records to this JSON file")


async def _one(client, url: str, body: dict, rec: RequestRecord) -> None:
    t0 = time.perf_counter()
    last = t0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = str(chunk["error"])[:200]
                    return
                if chunk.get("usage"):
                    rec.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                    rec.output_tokens = chunk["usage"].get("completion_tokens", 0)
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if rec.ttft is None:
                        rec.ttft = now - t0
                    else:
                        rec.itls.append(now - last)
                    last = now
        rec.ok = True
    except Exception as e:  # connection refused, reset, bad JSON: count it, keep going
        rec.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        rec.latency = time.perf_counter() - t0


def _stats(values: list[float]) -> dict:
    if not values:
        return {}
    ms = [v * 1e3 for v in values]
    return {"mean": round(statistics.fmean(ms), 2), "p50": round(percentile(ms, 50), 2),
            "p90": round(percentile(ms, 90), 2), "p99": round(percentile(ms, 99), 2)}


async def _run(a: argparse.Namespace) -> dict:
    import httpx

    rng = random.Random(a.seed)
    base = a.base_url.rstrip("/")
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=httpx.Limits(max_connections=None)) as client:
        model = a.model
        if model is None:
            model = (await client.get(base + "/v1/models")).json()["data"][0]["id"]
        prompts = [[rng.randrange(a.vocab_low, a.vocab_high) for _ in range(a.input_len)] for _ in range(a.num_prompts)]
        records = [RequestRecord() for _ in prompts]
        sem = asyncio.Semaphore(a.max_concurrency or a.num_prompts)

        async def go(i: int) -> None:
            body = {"model": model, "prompt": prompts[i], "max_tokens": a.output_len, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            async with sem:
                await _one(client, base + "/v1/completions", body, records[i])

        t0 = time.perf_counter()
        tasks = []
        for i in range(a.num_prompts):
            tasks.append(asyncio.create_task(go(i)))
            if a.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(a.request_rate))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0

    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    errors = [r.error for r in records if not r.ok]
    summary = {
        "base_url": base, "model": model, "num_prompts": a.num_prompts, "input_len": a.input_len,
        "output_len": a.output_len, "max_concurrency": a.max_concurrency, "request_rate": a.request_rate,
        "elapsed_s": round(elapsed, 2), "completed": len(ok), "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "request_throughput": round(len(ok) / elapsed, 3),
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        "input_tokens_per_s": round(sum(r.prompt_tokens for r in ok) / elapsed, 1),
        "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _stats([x for r in ok for x in r.itls]),
        "e2e_ms": _stats([r.latency for r in ok]),
    }
    print(json.dumps(summary, indent=2))
    if a.save_result:
        with open(a.save_result, "w") as f:
            json.dump({"summary": summary, "requests": [asdict(r) for r in records]}, f)
    return summary


def run(a: argparse.Namespace) -> dict:
    return asyncio.run(_run(a))
