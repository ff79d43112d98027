"""``kvserve bench serve``: the load loop against an OpenAI-compatible server, and its metrics.

A :class:`~kvserve.bench.datasets.Workload` is a list of sessions; each starts at its own time
(trace arrival, Poisson ``--request-rate``, or all at once) and sends its turns one after
another as streaming ``/v1/completions`` requests, bounded by ``--max-concurrency``. Every
request leaves a :class:`RequestRecord` (errors are counted, never fatal); :func:`summarize`
turns the records into a :class:`Summary`: throughput, TTFT, TPOT, ITL, end-to-end latency,
goodput under SLOs and, for the interference workload, the cohort's ITL before and during the
burst. Token counts are the server's own ``usage``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

from kvserve.bench import datasets, sse
from kvserve.bench.datasets import Turn, Workload
from kvserve.bench.stats import Dist, percentile
from kvserve.errors import KVServeError


@dataclass
class RequestRecord:
    index: int = 0
    session: int = 0
    turn: int = 0
    group: str = ""
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0  # from the server's usage
    output_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server reports it
    start: float = 0.0  # seconds after the run started, when the request was sent
    ttft: float | None = None
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # run-relative arrival of each text chunk

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class Interference:
    cohort_itl_p99_before_ms: float | None
    cohort_itl_p99_during_ms: float | None
    ratio: float | None
    burst_start_s: float
    burst_end_s: float


@dataclass
class Summary:
    base_url: str
    model: str
    dataset: str
    description: str
    num_requests: int
    max_concurrency: int | None
    request_rate: float
    elapsed_s: float
    completed: int
    errors: int
    first_error: str | None
    request_throughput: float
    input_tokens: int
    output_tokens: int
    input_tokens_per_s: float
    output_tokens_per_s: float
    ttft_ms: Dist | None
    tpot_ms: Dist | None
    itl_ms: Dist | None
    e2e_ms: Dist | None
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    slo_tpot_ms: float | None = None
    good_requests: int | None = None
    goodput: float | None = None  # requests/s meeting every SLO given
    shared_prefix_fraction: float | None = None
    prefix_hit_rate: float | None = None  # cached / prompt tokens, from the server's usage (None: not reported)
    interference: Interference | None = None


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    datasets.add_args(p)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="sessions/s (Poisson) for datasets without arrival times; inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request "
                   "(default: greedy)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: time to first token at most this")
    p.add_argument("--slo-itl-ms", type=float, default=None, help="goodput: every inter-token gap at most this")
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="goodput: mean time per output token after the first at most this")
    p.add_argument("--save-result", default=None, help="write the summary and per-request records to this JSON file")
    p.add_argument("--save-records", default=None, help="write one JSON line per request to this file")
    p.add_argument("--plot", default=None, help="write TTFT and ITL distributions to this PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--text-prompts", action="store_true",
                   help="send prompts as text (decoded with --tokenizer) for servers that take only strings; also "
                        "sends min_tokens = max_tokens, which such servers (llama.cpp) honour in place of ignore_eos")
    p.add_argument("--tokenizer", default=None, help="model folder or .gguf whose tokenizer decodes --text-prompts "
                                                     "(default: the embedded model's)")


def meets_slo(r: RequestRecord, slo_ttft_ms: float | None, slo_itl_ms: float | None,
              slo_tpot_ms: float | None = None) -> bool:
    """``slo_itl_ms`` bounds every gap between streamed chunks; ``slo_tpot_ms`` the request's mean time per
    output token after the first (vLLM's goodput "tpot"), which a chunk holding several tokens cannot skew."""
    if not r.ok:
        return False
    if slo_ttft_ms is not None and (r.ttft is None or r.ttft * 1e3 > slo_ttft_ms):
        return False
    if slo_tpot_ms is not None and (tpot := r.tpot) is not None and tpot * 1e3 > slo_tpot_ms:
        return False
    return slo_itl_ms is None or all(x * 1e3 <= slo_itl_ms for x in r.itls)


def cohort_itl_p99_ms(records: list[RequestRecord], start: float, end: float) -> float | None:
    """The cohort's ITL p99 (ms) over the gaps that end in [start, end) (run-relative seconds); None if none.
    A run without a burst gives the baseline of a burst run's window: the same stream positions, so the same
    context lengths."""
    gaps = [t - prev for r in records if r.group == "cohort" and r.ok
            for prev, t in zip(r.token_times, r.token_times[1:]) if start <= t < end]
    return round(percentile(gaps, 99) * 1e3, 2) if gaps else None


def interference(records: list[RequestRecord]) -> Interference | None:
    """Cohort ITL p99 for gaps that end before the first burst request is sent vs. while the burst runs."""
    burst = [r for r in records if r.group == "burst"]
    if not burst or not any(r.group == "cohort" and r.ok for r in records):
        return None
    b0 = min(r.start for r in burst)
    b1 = max(r.start + r.latency for r in burst)
    p_before = cohort_itl_p99_ms(records, 0.0, b0)
    p_during = cohort_itl_p99_ms(records, b0, b1 + 1e-9)
    ratio = round(p_during / p_before, 2) if p_before and p_during else None
    return Interference(p_before, p_during, ratio, round(b0, 3), round(b1, 3))


def summarize(records: list[RequestRecord], elapsed: float, workload: Workload, *, base_url: str = "",
              model: str = "", max_concurrency: int | None = None, request_rate: float = float("inf"),
              slo_ttft_ms: float | None = None, slo_itl_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> Summary:
    ok = [r for r in records if r.ok]
    errors = [r.error for r in records if not r.ok]
    elapsed = max(elapsed, 1e-9)
    n_in, n_out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    good = None
    if slo_ttft_ms is not None or slo_itl_ms is not None or slo_tpot_ms is not None:
        good = sum(meets_slo(r, slo_ttft_ms, slo_itl_ms, slo_tpot_ms) for r in records)
    return Summary(
        base_url=base_url, model=model, dataset=workload.name, description=workload.description,
        num_requests=len(records), max_concurrency=max_concurrency, request_rate=request_rate,
        elapsed_s=round(elapsed, 3), completed=len(ok), errors=len(errors),
        first_error=errors[0] if errors else None,
        request_throughput=round(len(ok) / elapsed, 3), input_tokens=n_in, output_tokens=n_out,
        input_tokens_per_s=round(n_in / elapsed, 1), output_tokens_per_s=round(n_out / elapsed, 1),
        ttft_ms=Dist.of([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=Dist.of([t for r in ok if (t := r.tpot) is not None]),
        itl_ms=Dist.of([x for r in ok for x in r.itls]),
        e2e_ms=Dist.of([r.latency for r in ok]),
        slo_ttft_ms=slo_ttft_ms, slo_itl_ms=slo_itl_ms, slo_tpot_ms=slo_tpot_ms, good_requests=good,
        goodput=round(good / elapsed, 3) if good is not None else None,
        shared_prefix_fraction=(round(workload.shared_prefix_fraction, 4)
                                if workload.shared_prefix_fraction is not None else None),
        prefix_hit_rate=(round(sum(r.cached_tokens or 0 for r in ok) / max(1, n_in), 4)
                         if any(r.cached_tokens is not None for r in ok) else None),
        interference=interference(records),
    )


async def stream_completion(client, url: str, body: dict, rec: RequestRecord, t0: float) -> None:
    """Send one streaming completion and fill ``rec``; any failure becomes ``rec.error``."""
    start = time.perf_counter()
    rec.start = start - t0
    last = start
    chunks_seen, got_usage = 0, False
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in sse.alines(resp.aiter_text()):
                data = sse.payload(line)
                if data is None:
                    continue
                if data == sse.DONE:
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = str(chunk["error"])[:200]
                    return
                if chunk.get("usage"):
                    got_usage = True
                    rec.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                    rec.output_tokens = chunk["usage"].get("completion_tokens", 0)
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        rec.cached_tokens = details["cached_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    chunks_seen += 1
                    now = time.perf_counter()
                    rec.token_times.append(now - t0)
                    if rec.ttft is None:
                        rec.ttft = now - start
                    else:
                        rec.itls.append(now - last)
                    last = now
        if not got_usage:  # a server without stream usage (llama.cpp): count the streamed chunks
            rec.output_tokens = chunks_seen  # prompt_tokens keeps the workload's own count
        rec.ok = True
    except Exception as e:  # connection refused, reset, bad JSON: count it, keep going
        rec.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        rec.latency = time.perf_counter() - start


Send = Callable[[Turn, RequestRecord, float], Awaitable[None]]


def session_starts(workload: Workload, request_rate: float, rng: random.Random) -> list[float]:
    """Each session's start: its own (trace, interference) or Poisson at ``request_rate``."""
    starts, t = [], 0.0
    for s in workload.sessions:
        if s.start is not None:
            starts.append(s.start)
        else:
            starts.append(t)
            if request_rate != float("inf"):
                t += rng.expovariate(request_rate)
    return starts


async def drive(workload: Workload, send: Send, *, request_rate: float = float("inf"),
                max_concurrency: int | None = None, seed: int = 0,
                on_done: Callable[[RequestRecord], None] | None = None) -> tuple[list[RequestRecord], float]:
    """Run every session of ``workload`` through ``send``; the records in session/turn order and
    the elapsed wall time. A session's next turn is sent only after its previous answer ended."""
    starts = session_starts(workload, request_rate, random.Random(seed))
    records: list[list[RequestRecord]] = []
    n = 0
    for si, s in enumerate(workload.sessions):
        records.append([])
        for ti, _ in enumerate(s.turns):
            records[-1].append(RequestRecord(index=n, session=si, turn=ti, group=s.group))
            n += 1
    sem = asyncio.Semaphore(max_concurrency or max(n, 1))
    t0 = time.perf_counter()

    async def run_session(si: int) -> None:
        delay = t0 + starts[si] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        for turn, rec in zip(workload.sessions[si].turns, records[si]):
            async with sem:
                await send(turn, rec, t0)
            if on_done:
                on_done(rec)

    await asyncio.gather(*(run_session(i) for i in range(len(workload.sessions))))
    return [r for rs in records for r in rs], time.perf_counter() - t0


async def run_workload(a: argparse.Namespace, workload: Workload) -> tuple[Summary, list[RequestRecord]]:
    """Drive ``workload`` against ``a.base_url`` with streaming completions (token-id prompts,
    greedy unless --temperature, ignore_eos), a progress bar while it runs."""
    import httpx
    from tqdm import tqdm

    base = a.base_url.rstrip("/")
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                 limits=httpx.Limits(max_connections=None)) as client:
        model = a.model
        if model is None:
            try:
                model = (await client.get(base + "/v1/models")).json()["data"][0]["id"]
            except Exception as e:  # unreachable or not OpenAI-compatible: say so in one line
                raise KVServeError(f"cannot list models at {base}/v1/models ({type(e).__name__}: {e}); "
                                   "is the server up? --model skips this") from e

        texts = _as_texts(workload, a.tokenizer) if a.text_prompts else None

        async def send(turn: Turn, rec: RequestRecord, t0: float) -> None:
            body = {"model": model, "prompt": turn.prompt, "max_tokens": turn.max_tokens, "temperature": a.temperature,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            rec.prompt_tokens = len(turn.prompt)  # the server's usage, when it sends one, replaces it
            if texts is not None:
                body["prompt"] = texts[id(turn)]
                body["min_tokens"] = turn.max_tokens
            await stream_completion(client, base + "/v1/completions", body, rec, t0)

        with tqdm(total=workload.num_requests, unit="req", desc=workload.name,
                  disable=True if a.no_progress else None) as bar:
            failed = 0

            def done(rec: RequestRecord) -> None:
                nonlocal failed
                bar.update(1)
                if not rec.ok:
                    failed += 1
                    bar.set_postfix(errors=failed)

            records, elapsed = await drive(workload, send, request_rate=a.request_rate,
                                           max_concurrency=a.max_concurrency, seed=a.seed, on_done=done)
    summary = summarize(records, elapsed, workload, base_url=base, model=model, max_concurrency=a.max_concurrency,
                        request_rate=a.request_rate, slo_ttft_ms=a.slo_ttft_ms, slo_itl_ms=a.slo_itl_ms,
                        slo_tpot_ms=a.slo_tpot_ms)
    return summary, records


def _as_texts(workload: Workload, tokenizer: str | None) -> dict[int, str]:
    """Each turn's prompt decoded to text (by turn identity), for servers that take only strings."""
    from kvserve.model.loader import load_tokenizer, resolve_model_path

    tok = load_tokenizer(resolve_model_path(tokenizer))
    return {id(t): tok.decode(t.prompt) for s in workload.sessions for t in s.turns}


def run(a: argparse.Namespace) -> Summary:
    from kvserve.bench import report

    report.check_plot_available(a.plot)
    workload = datasets.build(a)
    summary, records = asyncio.run(run_workload(a, workload))
    print(report.format_summary(summary))
    if a.save_result:
        with open(a.save_result, "w") as f:
            json.dump({"summary": asdict(summary), "requests": [asdict(r) for r in records]}, f)
    if a.save_records:
        report.write_records(a.save_records, records)
    if a.plot:
        report.plot({summary.base_url: records}, a.plot)
    return summary
