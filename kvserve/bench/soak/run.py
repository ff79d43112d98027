"""The soak's main loop: clients sending the mix, /metrics sampled as it runs, then the wait for idle."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from typing import Any

from kvserve.bench import prometheus
from kvserve.bench.soak.checks import Checker, Outcome
from kvserve.bench.soak.report import build_result
from kvserve.bench.soak.traffic import SoakConfig, Traffic

_METRICS = {
    "server_rss": "process_resident_memory_bytes", "engine_rss": "kvserve_engine_resident_memory_bytes",
    "running": "kvserve_num_requests_running", "waiting": "kvserve_num_requests_waiting",
    "kv_used": "kvserve_kv_cache_blocks_used", "kv_cached": "kvserve_kv_cache_blocks_cached",
    "kv_total": "kvserve_kv_cache_blocks_capacity", "preemptions": "kvserve_num_preemptions_total",
    "generation_tokens": "kvserve_generation_tokens_total",
}


async def sample(client: Any, base: str, t: float) -> dict[str, float | None]:
    got = prometheus.totals((await client.get(base + "/metrics", timeout=30)).text)
    return {"t": round(t, 2), **{k: got.get(name) for k, name in _METRICS.items()}}


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

    return build_result(cfg, outcomes, samples, final, monitor_errors, healthy, traffic_s, warmup, model)
