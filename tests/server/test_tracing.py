"""Request tracing: a span per request with its stages as events, the client's traceparent as parent,
aborted and failed requests ending in an error status; spans posted over OTLP/HTTP; the flag's errors."""

from __future__ import annotations

import http.server
import random
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import StatusCode  # noqa: E402

from kvserve.config import KVServeConfig, ServerConfig  # noqa: E402
from kvserve.engine.messages import RequestDelta, RequestTimeline  # noqa: E402
from kvserve.engine.request import SamplingParams  # noqa: E402
from kvserve.errors import InvalidArgumentError  # noqa: E402
from kvserve.server.engine_client import AsyncEngineClient  # noqa: E402
from kvserve.server.tracing import RequestTracer  # noqa: E402
from kvserve.text.output import RequestOutput  # noqa: E402
from server_utils import TINY_ENGINE, ServerThread  # noqa: E402

STAGES = ["queued", "scheduled", "first_token", "decode_done"]


@pytest.fixture(scope="module")
def traced(tiny_model_dir):
    """A tiny-model server whose KV pool (32 blocks of 16) is small enough to evict, with a host tier
    below it, tracing into memory."""
    engine = {**TINY_ENGINE, "num_kv_blocks": 32, "kv_offload_memory_gb": 0.01}
    client = AsyncEngineClient(KVServeConfig.from_kwargs(model=str(tiny_model_dir), **engine))
    with ServerThread(client, ServerConfig(served_model_names=["tiny"])) as server:
        exporter = InMemorySpanExporter()
        server.app.state.server.tracer = RequestTracer(exporter, batch=False)
        yield server, exporter


def spans_after(exporter, n: int, timeout: float = 20.0):
    """Wait until ``n`` spans were exported (an abort ends its span when the server sees the disconnect)."""
    deadline = time.monotonic() + timeout
    while len(exporter.get_finished_spans()) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    spans = exporter.get_finished_spans()
    assert len(spans) == n, [s.name for s in spans]
    return spans


def complete(server, prompt, headers=None, **kw):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **kw}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def test_a_span_per_request_with_its_stages_in_order(traced):
    server, exporter = traced
    exporter.clear()
    prompt = prompt_of(1, 40)
    r = complete(server, [prompt, prompt_of(2, 30)], max_tokens=5)
    assert r.status_code == 200
    spans = spans_after(exporter, 2)
    by_input = {s.attributes["gen_ai.usage.input_tokens"]: s for s in spans}
    assert set(by_input) == {40, 30}
    for span in spans:
        assert span.name == "llm_request" and span.status.status_code == StatusCode.OK
        assert span.parent is None  # no traceparent: a root span
        assert [e.name for e in span.events] == STAGES
        times = [span.start_time] + [e.timestamp for e in span.events] + [span.end_time]
        assert times == sorted(times)
        a = span.attributes
        assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == "tiny"
        assert a["gen_ai.usage.output_tokens"] == 5 and a["gen_ai.response.finish_reasons"] == ("length",)
        assert a["gen_ai.request.max_tokens"] == 5 and a["kvserve.request.id"]
        assert 0 <= span.events[1].attributes["kvserve.queue_time_s"] < 60
    assert len({s.attributes["kvserve.request.id"] for s in spans}) == 2

    # the same prompt again: its first 32 tokens (two blocks) come from the prefix cache
    exporter.clear()
    assert complete(server, prompt).status_code == 200
    (span,) = spans_after(exporter, 1)
    assert span.attributes["gen_ai.usage.cache_read.input_tokens"] == 32
    assert span.attributes["gen_ai.usage.output_tokens"] == 4


def test_the_clients_traceparent_is_the_parent(traced):
    server, exporter = traced
    exporter.clear()
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"traceparent": f"00-{trace_id}-{parent_id}-01"}
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=headers, timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    (span,) = spans_after(exporter, 1)
    assert span.context.trace_id == int(trace_id, 16)
    assert span.parent is not None and span.parent.span_id == int(parent_id, 16) and span.parent.is_remote
    assert span.attributes["gen_ai.operation.name"] == "chat"
    assert span.attributes["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"]

    # a malformed traceparent is ignored (a root span), never an error
    exporter.clear()
    assert complete(server, prompt_of(3, 5), headers={"traceparent": "00-zz-yy-01"}).status_code == 200
    (span,) = spans_after(exporter, 1)
    assert span.parent is None


def test_a_prefix_restored_from_a_tier_is_an_event(traced):
    server, exporter = traced
    prompt = prompt_of(4, 100)  # six full blocks before the last token
    assert complete(server, prompt).status_code == 200
    for seed in range(5, 9):  # unrelated prompts fill the 32-block pool: the first prompt's blocks go to the host tier
        assert complete(server, prompt_of(seed, 200)).status_code == 200
    exporter.clear()
    assert complete(server, prompt).status_code == 200
    (span,) = spans_after(exporter, 1)
    names = [e.name for e in span.events]
    assert names == ["queued", "scheduled", "tier_restore", "first_token", "decode_done"]
    restore = span.events[2]
    assert restore.attributes["kvserve.kv.tier"] == "host" and restore.attributes["kvserve.kv.blocks"] == 6
    assert span.attributes["gen_ai.usage.cache_read.input_tokens"] == 96


def test_an_aborted_request_ends_its_span_with_an_error(traced):
    server, exporter = traced
    exporter.clear()
    body = {"model": "tiny", "prompt": prompt_of(9, 10), "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # the first tokens arrived: hang up
    (span,) = spans_after(exporter, 1)
    assert span.status.status_code == StatusCode.ERROR and span.attributes["error.type"] == "aborted"
    assert [e.name for e in span.events][:3] == ["queued", "scheduled", "first_token"]


def test_a_request_the_engine_refuses_ends_its_span_with_an_error(traced):
    server, exporter = traced
    exporter.clear()
    r = complete(server, prompt_of(10, 5), stop_token_ids=[10 ** 6])  # past the vocabulary: the engine's check
    assert r.status_code == 400
    (span,) = spans_after(exporter, 1)
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["error.type"] == "InvalidArgumentError" and not span.events


class _Collector(http.server.BaseHTTPRequestHandler):
    received: list[tuple[str, str, bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, self.headers["Content-Type"], body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_spans_are_posted_over_otlp_http():
    """The real OTLP/HTTP exporter against a local endpoint: one protobuf POST to /v1/traces."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    collector = http.server.HTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    try:
        tracer = RequestTracer.otlp(f"http://127.0.0.1:{collector.server_port}")  # the path is added
        t0 = time.monotonic()
        trace = tracer.begin("r1", t0, {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
                             model="m", operation="text_completion", params=SamplingParams(max_tokens=2))
        delta = RequestDelta("r1", [5], [], False, None, None, 3, 0,
                             timeline=RequestTimeline(t0 + 0.001, t0 + 0.002, t0 + 0.003, {"redis": 2}))
        trace.on_delta(t0 + 0.004, delta)
        trace.finish(RequestOutput("r1", [1, 2, 3], "ab", [5, 6], "", [], True, "length"))
        tracer.shutdown()  # flushes the batch
    finally:
        collector.shutdown()
    (path, ctype, body), = _Collector.received
    assert path == "/v1/traces" and ctype == "application/x-protobuf"
    req = ExportTraceServiceRequest.FromString(body)
    (span,) = [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert span.name == "llm_request" and span.trace_id.hex() == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert [e.name for e in span.events] == ["queued", "scheduled", "tier_restore", "first_token", "decode_done"]
    attrs = {a.key: a.value for a in span.attributes}
    assert attrs["gen_ai.usage.output_tokens"].int_value == 2 and attrs["gen_ai.usage.input_tokens"].int_value == 3
    service = {a.key: a.value.string_value for a in req.resource_spans[0].resource.attributes}
    assert service["service.name"] == "kvserve"


def test_the_flag_needs_an_http_url_and_the_packages(monkeypatch):
    with pytest.raises(InvalidArgumentError, match="http"):
        ServerConfig(otlp_traces_endpoint="grpc://127.0.0.1:4317")
    import kvserve.config

    monkeypatch.setattr(kvserve.config, "_installed", lambda module: False)
    with pytest.raises(InvalidArgumentError, match=r"pip install kvserve\[tracing\]"):
        ServerConfig(otlp_traces_endpoint="http://127.0.0.1:4318")


def test_the_cli_says_so_in_one_line():
    r = subprocess.run([sys.executable, "-m", "kvserve", "serve", "--otlp-traces-endpoint", "localhost:4318"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--otlp-traces-endpoint" in lines[0] and "Traceback" not in r.stderr
