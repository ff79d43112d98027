"""``kvserve serve --replicas 2`` on the embedded model, end to end, as a user runs it.

Greedy answers through it are a single server's; /health reports both replicas; a replica killed
mid-run loses no request that had not started streaming (retried on the other; streams that had
started end with an error event) and is restarted; SIGTERM leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvserve.bench.prometheus import metric
from server_utils import spawn_serve

pytestmark = pytest.mark.e2e

FLOAT32 = ["--dtype", "float32", "--kv-cache-memory-gb", "0.25", "--uvicorn-log-level", "warning"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
START_TIMEOUT_S = 900  # loading the model is slow on a busy 2-core machine


def start(*args: str, log_path) -> tuple[subprocess.Popen, str]:
    return spawn_serve(*args, log=log_path, timeout=START_TIMEOUT_S)


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def complete(url: str, prompt: str, max_tokens: int = 8) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=600,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    log = tmp_path_factory.mktemp("replicas") / "serve.log"
    proc, url = start("--replicas", "2", *FLOAT32, log_path=log)
    yield proc, url
    stop(proc)


def test_replicas_answer_as_one_server_and_report_health(replicated, tmp_path):
    proc, url = replicated
    health = httpx.get(f"{url}/health").json()
    assert health == {"status": "ok", "backends": 2, "healthy": 2}
    backends = httpx.get(f"{url}/admin/backends").json()
    assert backends["policy"] == "cache-aware" and len(backends["backends"]) == 2
    assert all(b["url"].startswith("http://127.0.0.1:") for b in backends["backends"])
    through = [complete(url, p)["choices"][0]["text"] for p in PROMPTS]
    single, single_url = start(*FLOAT32, log_path=tmp_path / "single.log")
    try:
        direct = [complete(single_url, p)["choices"][0]["text"] for p in PROMPTS]
    finally:
        assert stop(single) == 0
    assert through == direct
    assert all(through)


def _stream(url: str, prompt: str, max_tokens: int) -> tuple[bytes, float | None]:
    """The raw stream, and when its first byte came (None: none came)."""
    raw, first = b"", None
    with httpx.stream("POST", f"{url}/v1/completions", timeout=600,
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                            "stream": True}) as r:
        assert r.status_code == 200
        for chunk in r.iter_raw():
            first = first or time.monotonic()
            raw += chunk
    return raw, first


def test_a_replica_killed_mid_run_loses_no_request_that_had_not_started_streaming(replicated):
    proc, url = replicated
    n_tokens = 32
    prompts = [f"Request {i}: write a long story about the number {i}." for i in range(10)]
    with ThreadPoolExecutor(len(prompts) + 2) as pool:
        plain = [pool.submit(complete, url, p, n_tokens) for p in prompts]
        streams = [pool.submit(_stream, url, f"Stream {i}: tell me about rivers.", n_tokens) for i in range(2)]
        # wait until both replicas have requests in flight, then kill one outright
        deadline = time.monotonic() + 300
        while True:
            states = httpx.get(f"{url}/admin/backends").json()["backends"]
            if all(b["in_flight"] > 0 for b in states):
                break
            assert time.monotonic() < deadline, states
            time.sleep(0.05)
        victim = states[0]["url"]
        port = victim.rsplit(":", 1)[1]
        # the replica's own process (its engine process's command line names no port)
        pids = [p for p in descendants(proc.pid) if f"--port\0{port}\0" in open(f"/proc/{p}/cmdline").read()]
        assert len(pids) == 1
        killed_at = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        answers = [f.result(timeout=600) for f in plain]
        streamed = [f.result(timeout=600) for f in streams]
    # every non-streaming request was answered in full (those on the killed replica were retried)
    assert all(a["usage"]["completion_tokens"] == n_tokens for a in answers)
    text = httpx.get(f"{url}/metrics").text
    assert metric(text, "kvserve_router_retries_total", backend=victim) >= 1
    # a stream either finished, or had started before the kill and ends with the router's error event
    for raw, first in streamed:
        assert raw.endswith(b"data: [DONE]\n\n")
        if b'"backend_failed"' in raw:
            assert first is not None and first < killed_at + 1.0
    # the killed replica is restarted and comes back into routing
    deadline = time.monotonic() + 600
    while httpx.get(f"{url}/health").json()["healthy"] < 2:
        assert time.monotonic() < deadline, "the killed replica was not restarted"
        time.sleep(0.5)
    assert complete(url, PROMPTS[0])["usage"]["completion_tokens"] == 8


def test_sigterm_stops_the_router_and_every_replica(replicated):
    proc, url = replicated
    below = descendants(proc.pid)
    assert len(below) >= 4  # two replicas, each with its engine process
    assert stop(proc) == 0
    deadline = time.monotonic() + 30
    while any(alive(p) for p in below):
        assert time.monotonic() < deadline, [p for p in below if alive(p)]
        time.sleep(0.2)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)


def test_bad_replica_counts_are_one_line_errors():
    for n, needle in (("0", "at least 1"), ("100000", "each replica needs a thread")):
        r = subprocess.run([sys.executable, "-m", "kvserve", "serve", "--replicas", n], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvserve: error:") and needle in lines[0], r.stderr
