#!/usr/bin/env python
"""What `kvserve router` adds per request, and how many requests/s it forwards on one core.

A fake backend that answers at once (a raw ASGI app under uvicorn: /health, /kv/events with a hash
scheme so the router hashes every prompt, /v1/completions streaming and not) runs on one core,
`kvserve router` in front of it pinned to another (taskset), and a client (this script) sends the
same requests to the backend directly and through the router:
- latency: one request at a time (N of each kind); the router's added latency is the difference
  of the medians (and of the 99th percentiles);
- throughput: CONC requests at once for SECONDS; the router's limit is its requests/s when the
  direct rate is well above it (then the router, not the backend or the client, is the bound);
- CPU: the router process's CPU time per request over the latency run (from /proc), and the rate
  one core would allow at that cost, which holds even on a machine busy with other work.

Usage: .venv/bin/python scripts/bench_router.py [--router-cpu 0 --backend-cpu 1 --requests 500
       --concurrency 32 --seconds 10 --output-json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

PROMPT = ("You are a helpful assistant. Answer the question using the document below.\n" * 4
          + "Question: what does a router add to each request, and how much of a core does it use?")


# -- the fake backend ---------------------------------------------------------------------------
def fake_backend_app() -> Any:
    """An ASGI app that answers what the router asks of a replica, at once."""
    from kvserve.server.kv_events import HASH_ALGORITHM

    completion = json.dumps({
        "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake",
        "choices": [{"index": 0, "text": " Paris.", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
                  "prompt_tokens_details": {"cached_tokens": 0}}}).encode()
    chunk = 'data: {"id":"cmpl-fake","object":"text_completion","created":0,"model":"fake","choices":' \
            '[{"index":0,"text":"%s","logprobs":null,"finish_reason":null}]}\n\n'
    stream = [(chunk % " Paris").encode(), (chunk % ".").encode(), b"data: [DONE]\n\n"]
    events = {"replica_id": "fake", "epoch": "e", "enabled": True, "block_size": 16,
              "hash_scheme": {"algorithm": HASH_ALGORITHM, "root_key": "00" * 16, "block_size": 16,
                              "token_bytes": 4, "byteorder": "little", "match": "prompt[:-1]"},
              "seq": 0, "reset": True, "stored": [], "removed": [], "num_cached_blocks": 0,
              "load": {"running": 0, "waiting": 0, "kv_usage": 0.0}}

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        path = scope["path"]
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if path == "/kv/events":
            query = dict(p.split("=", 1) for p in scope["query_string"].decode().split("&") if "=" in p)
            await asyncio.sleep(min(float(query.get("wait", 0)), 10.0))  # a long poll: nothing changes
            payload = json.dumps({**events, "reset": "since" not in query}).encode()
            await _send(send, 200, b"application/json", [payload])
        elif path == "/health":
            await _send(send, 200, b"application/json", [b'{"status":"ok"}'])
        elif path == "/v1/completions":
            if b'"stream": true' in body or b'"stream":true' in body:
                await _send(send, 200, b"text/event-stream", stream)
            else:
                await _send(send, 200, b"application/json", [completion])
        else:
            await _send(send, 404, b"application/json", [b'{"error":{"message":"not found"}}'])

    return app


async def _send(send: Any, status: int, content_type: bytes, parts: list[bytes]) -> None:
    headers = [(b"content-type", content_type)]
    if len(parts) == 1:
        headers.append((b"content-length", str(len(parts[0])).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    for i, part in enumerate(parts):
        await send({"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1})


def run_fake_backend(port: int) -> None:
    import uvicorn

    uvicorn.run(fake_backend_app(), host="127.0.0.1", port=port, log_level="warning", access_log=False)


# -- the client ---------------------------------------------------------------------------------
def _body(stream: bool) -> dict[str, Any]:
    return {"model": "fake", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "stream": stream}


async def _one(client: Any, url: str, stream: bool) -> float:
    t0 = time.perf_counter()
    if stream:
        async with client.stream("POST", f"{url}/v1/completions", json=_body(True)) as r:
            async for _ in r.aiter_raw():
                pass
    else:
        r = await client.post(f"{url}/v1/completions", json=_body(False))
    assert r.status_code == 200, r.status_code
    return time.perf_counter() - t0


async def latencies(url: str, stream: bool, n: int) -> list[float]:
    import httpx

    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        for _ in range(20):  # warm up the connection and the router's code paths
            await _one(client, url, stream)
        return [await _one(client, url, stream) for _ in range(n)]


async def throughput(url: str, stream: bool, concurrency: int, seconds: float) -> float:
    import httpx

    done = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(trust_env=False, timeout=60, limits=limits) as client:
        end = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < end:
                await _one(client, url, stream)
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - t0)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc), whatever else the machine runs."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _wait(url: str, path: str = "/health", timeout: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not come up")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fake-backend", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the child's role
    p.add_argument("--router-cpu", default="0", help="taskset CPU list for the router (default: %(default)s)")
    p.add_argument("--backend-cpu", default="1", help="taskset CPU list for the fake backend and this client")
    p.add_argument("--requests", type=int, default=500, help="sequential requests per latency row")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seconds", type=float, default=10.0, help="per throughput row")
    p.add_argument("--output-json", default=None)
    a = p.parse_args()
    if a.fake_backend:
        run_fake_backend(a.fake_backend)
        return

    os.sched_setaffinity(0, {int(c) for c in a.backend_cpu.split(",")})  # the client beside the backend
    bport, rport = _free_port(), _free_port()
    backend_url, router_url = f"http://127.0.0.1:{bport}", f"http://127.0.0.1:{rport}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen(["taskset", "-c", a.backend_cpu, sys.executable, __file__, "--fake-backend", str(bport)],
                              env=env)]
    try:
        _wait(backend_url)
        procs.append(subprocess.Popen(["taskset", "-c", a.router_cpu, sys.executable, "-m", "kvserve", "router",
                                       "--port", str(rport), "--backend", backend_url, "--log-level", "warning"],
                                      env=env))
        _wait(router_url, timeout=300)
        time.sleep(1.5)  # the router's first /kv/events answer (the hash scheme) is in
        rows: dict[str, Any] = {}
        for stream in (False, True):
            kind = "stream" if stream else "json"
            direct = asyncio.run(latencies(backend_url, stream, a.requests))
            cpu0 = cpu_seconds(procs[1].pid)
            routed = asyncio.run(latencies(router_url, stream, a.requests))
            # the router's CPU per request (its health checks and event polls included): on a shared
            # machine, a steadier measure of its cost than its latency or rate
            cpu_ms = 1e3 * (cpu_seconds(procs[1].pid) - cpu0) / (a.requests + 20)
            rows[f"latency_{kind}"] = {
                "direct_p50_ms": 1e3 * statistics.median(direct), "direct_p99_ms": 1e3 * pct(direct, 99),
                "router_p50_ms": 1e3 * statistics.median(routed), "router_p99_ms": 1e3 * pct(routed, 99),
                "added_p50_ms": 1e3 * (statistics.median(routed) - statistics.median(direct)),
                "added_p99_ms": 1e3 * (pct(routed, 99) - pct(direct, 99)),
                "router_cpu_ms_per_request": cpu_ms, "router_rps_per_core_from_cpu": 1e3 / cpu_ms}
            rows[f"throughput_{kind}"] = {
                "direct_rps": asyncio.run(throughput(backend_url, stream, a.concurrency, a.seconds)),
                "router_rps": asyncio.run(throughput(router_url, stream, a.concurrency, a.seconds))}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu": _cpu_model(),
              "load_avg_1m": os.getloadavg()[0], "args": vars(a), "python": platform.python_version(), **rows}
    print(json.dumps(result, indent=1))
    for kind in ("json", "stream"):
        lat, thr = rows[f"latency_{kind}"], rows[f"throughput_{kind}"]
        print(f"{kind:6s}: router CPU {lat['router_cpu_ms_per_request']:.2f} ms/request (at most "
              f"{lat['router_rps_per_core_from_cpu']:.0f} req/s per core); "
              f"added p50 {lat['added_p50_ms']:.2f} ms, p99 {lat['added_p99_ms']:.2f} ms "
              f"(direct {lat['direct_p50_ms']:.2f}/{lat['direct_p99_ms']:.2f}, via router "
              f"{lat['router_p50_ms']:.2f}/{lat['router_p99_ms']:.2f}); router {thr['router_rps']:.0f} req/s on one "
              f"core (direct {thr['direct_rps']:.0f} req/s)")
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(result, f, indent=1)


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    main()
