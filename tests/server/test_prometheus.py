"""Prometheus for real: both /metrics pass ``promtool check metrics``, and a real Prometheus that
scrapes a server and a router under load answers every PromQL expression of the Grafana dashboard
(deploy/grafana/kvserve-dashboard.json) with data.

One replica (the tiny random model, drafting for itself so that the speculation panels have
something to show) behind ``kvserve router``; the load goes through the router: plain and
streamed completions and chats, prompts sharing a prefix, JSON-mode requests (the grammar
cache), and a few bad requests (HTTP 400s). Prometheus and promtool are Debian's (make test installs
them as root); the tests that need them skip without them, in their fixtures too.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvserve.bench import dashboard
from kvserve.bench.prometheus import metric
from kvserve.config import KVServeConfig, ServerConfig
from kvserve.router.app import create_router_app
from kvserve.router.config import RouterConfig
from kvserve.router.prompt import PromptTokenizer
from server_utils import TINY_ENGINE, AppThread, ServerThread

pytestmark = pytest.mark.component
PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
NO_PROMETHEUS = "no prometheus binary on the PATH (Debian: apt-get install prometheus; make test does as root)"
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason=NO_PROMETHEUS)
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="no promtool binary on the PATH (Debian: apt-get install prometheus; make test does as root)")
GREEDY = {"model": "tiny", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
SCRAPE_S = 1


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    """A replica and a router over it, and the time before the load; the load ran once both were up."""
    from kvserve.server.engine_client import AsyncEngineClient

    # the model drafts for itself: every draft is accepted, but drafts are verified and counted as any others
    # (n-gram lookup on a random model's output finds nothing to draft)
    client = AsyncEngineClient(KVServeConfig.from_kwargs(model=str(tiny_model_dir), speculative_method="draft",
                                                         speculative_model=str(tiny_model_dir),
                                                         adaptive_speculation=False, **TINY_ENGINE))
    with ServerThread(client, ServerConfig(served_model_names=["tiny"])) as server:
        config = RouterConfig(backends=[server.url], health_interval_s=0.5, events_wait_s=0.5)
        with AppThread(create_router_app(config, PromptTokenizer.load(str(tiny_model_dir)))) as router:
            deadline = time.monotonic() + 15
            while not all(b["healthy"] for b in httpx.get(f"{router.url}/admin/backends").json()["backends"]):
                assert time.monotonic() < deadline, "the router never saw its backend healthy"
                time.sleep(0.05)
            yield server, router


def bodies(n: int) -> list[tuple[str, dict]]:
    """``n`` requests: a mix of routes, streaming, shared prefixes, JSON mode and bad parameters."""
    rng = random.Random(0)
    shared = [rng.randrange(3, 49152) for _ in range(64)]  # four full blocks every "rag" prompt starts with
    out = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            out.append(("/v1/completions", {**GREEDY, "prompt": shared + [100 + i, 200 + i]}))
        elif kind == 1:
            out.append(("/v1/completions", {**GREEDY, "prompt": [rng.randrange(3, 49152) for _ in range(40)], "stream": True,
                                            "stream_options": {"include_usage": True}}))
        elif kind == 2:
            out.append(("/v1/chat/completions", {**GREEDY, "messages": [{"role": "user", "content": f"Hello {i}"}],
                                                 "stream": i % 2 == 0}))
        elif kind == 3:
            out.append(("/v1/completions", {**GREEDY, "prompt": f"JSON {i}:", "max_tokens": 8,
                                            "response_format": {"type": "json_object"}}))
        elif kind == 4:
            out.append(("/v1/completions", {**GREEDY, "prompt": shared + [300 + i], "max_tokens": 4}))
        else:
            out.append(("/v1/completions", {**GREEDY, "prompt": "x", "temperature": -1}))  # 400
    return out


def send(url: str, path: str, body: dict) -> int:
    if body.get("stream"):
        with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as r:
            raw = r.read()
            assert r.status_code != 200 or raw.endswith(b"data: [DONE]\n\n")
            return r.status_code
    return httpx.post(f"{url}{path}", json=body, timeout=60).status_code


@pytest.fixture(scope="module")
def loaded(stack, request):
    """The stack after 36 requests through the router, 4 at a time, in three waves a few scrapes apart
    (so every rate sees its counters grow, even where a fast machine finishes a wave between two
    scrapes and a series first appears with its wave); the load's start time. Prometheus, where it is
    installed, scrapes before and during the load; the tests that read only /metrics run without it."""
    server, router = stack
    start = time.time()
    if PROMETHEUS is not None:
        prometheus = request.getfixturevalue("prometheus")
        deadline = time.monotonic() + 30
        while scraped(prometheus, 'sum(up{job=~"kvserve.*"})') < 2:  # both targets scraped once before any load
            assert time.monotonic() < deadline, "Prometheus did not scrape the replica and the router in 30 s"
            time.sleep(0.2)
    work = bodies(36)
    statuses = []
    with ThreadPoolExecutor(4) as pool:
        for wave in (work[:12], work[12:24], work[24:]):
            statuses += pool.map(lambda pb: send(router.url, *pb), wave)
            time.sleep(2 * SCRAPE_S)
    assert statuses.count(400) == 6 and statuses.count(200) == 30, statuses
    return server, router, start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory):
    """A real Prometheus on 127.0.0.1 scraping the replica and the router every second."""
    if PROMETHEUS is None:
        pytest.skip(NO_PROMETHEUS)
    server, router = stack
    folder = tmp_path_factory.mktemp("prometheus")
    (folder / "prometheus.yml").write_text(f"""
global: {{scrape_interval: {SCRAPE_S}s, evaluation_interval: {SCRAPE_S}s}}
scrape_configs:
  - job_name: kvserve
    static_configs: [{{targets: ["127.0.0.1:{server.port}"]}}]
  - job_name: kvserve-router
    static_configs: [{{targets: ["127.0.0.1:{router.port}"]}}]
""")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={folder / 'prometheus.yml'}",
                             f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, f"prometheus exited: {proc.stderr.read().decode()[-2000:]}"
            assert time.monotonic() < deadline, "prometheus was not ready in 30 s"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def scraped(prometheus: str, expr: str) -> float:
    body = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}).json()
    return sum(float(r["value"][1]) for r in body["data"]["result"])


@needs_prometheus
def test_every_dashboard_query_returns_data_from_a_real_prometheus(prometheus, loaded):
    server, router, start = loaded
    # Prometheus has scraped the end of the load: its counters match what /metrics says now
    server_done = metric(httpx.get(f"{server.url}/metrics").text, "kvserve_request_success_total")
    router_done = metric(httpx.get(f"{router.url}/metrics").text, "kvserve_router_requests_total")
    deadline = time.monotonic() + 30
    while (scraped(prometheus, "sum(kvserve_request_success_total)") < server_done
           or scraped(prometheus, "sum(kvserve_router_requests_total)") < router_done):
        assert time.monotonic() < deadline, "Prometheus did not scrape the load's counters in 30 s"
        time.sleep(0.2)
    time.sleep(2 * SCRAPE_S)  # and a rate window's last samples

    instances = dashboard.label_values(prometheus, "instance", "kvserve_num_requests_running")
    assert instances == [f"127.0.0.1:{server.port}"]
    panels = dashboard.panels(dashboard.load())
    assert {p.row for p in panels} == {"Replica $instance", "Router"}
    empty, queries = [], 0
    for panel in panels:
        for target in panel.targets:
            expr = dashboard.fill(target.expr, {"instance": instances[0]}, rate_interval="10s")
            series = dashboard.query_range(prometheus, expr, start, time.time(), SCRAPE_S, target.legend)
            queries += 1
            if not dashboard.has_numbers(series):
                empty.append(f"{panel.title}: {expr}")
    assert queries >= 30
    assert not empty, "queries without data:\n" + "\n".join(empty)


@needs_promtool
def test_metrics_pass_promtool(loaded):
    server, router, _ = loaded
    for url in (server.url, router.url):
        text = httpx.get(f"{url}/metrics").text
        assert "kvserve_" in text
        lint = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert lint.returncode == 0 and not (lint.stdout + lint.stderr).strip(), (url, lint.stdout + lint.stderr)


def test_http_responses_are_counted_by_route_and_status(loaded):
    server, router, _ = loaded
    text = httpx.get(f"{server.url}/metrics").text
    assert metric(text, "kvserve_http_requests_total", route="/v1/completions", status="400") == 6
    assert metric(text, "kvserve_http_requests_total", route="/v1/chat/completions", status="200") == 6
    httpx.get(f"{server.url}/no/such/route")
    text = httpx.get(f"{server.url}/metrics").text
    assert metric(text, "kvserve_http_requests_total", route="other", status="404") == 1
