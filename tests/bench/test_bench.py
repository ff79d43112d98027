"""The benchmarks' arithmetic, the workloads, and the serving benchmark against a live and a dead server."""

import argparse
import asyncio
import json
import time

import pytest

from kvserve.bench import datasets, report
from kvserve.bench import serve as bench_serve
from kvserve.bench.datasets import Session, TraceRow, Turn, Workload
from kvserve.bench.stats import percentile
from kvserve.errors import InvalidArgumentError
from kvserve.bench.serve import RequestRecord, summarize
from kvserve.config import KVServeConfig
from kvserve.server.engine_client import AsyncEngineClient
from kvserve.errors import InvalidArgumentError, KVServeError
from kvserve.config import ServerConfig
from server_utils import ServerThread, free_socket


def test_percentile_interpolates_like_numpy():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile([7.0], 99) == 7.0


def test_tpot_excludes_the_first_token():
    r = RequestRecord(ok=True, output_tokens=5, ttft=0.5, latency=1.3)
    assert r.tpot == pytest.approx(0.2)
    assert RequestRecord(ok=True, output_tokens=1, ttft=0.5, latency=0.5).tpot is None


def _timeline(ttft: float, itls: list[float], ok: bool = True) -> RequestRecord:
    return RequestRecord(ok=ok, error=None if ok else "boom", prompt_tokens=10, output_tokens=len(itls) + 1,
                         ttft=ttft, latency=ttft + sum(itls), itls=itls)


def test_summary_goodput_and_latency_arithmetic():
    recs = [_timeline(0.1, [0.02, 0.02]),   # meets both SLOs
            _timeline(0.3, [0.02, 0.02]),   # TTFT too slow
            _timeline(0.1, [0.02, 0.09]),   # one gap too slow
            _timeline(0.1, [0.01], ok=False)]
    w = Workload("random", [Session([Turn([1], 3)]) for _ in recs])
    s = summarize(recs, 2.0, w, slo_ttft_ms=200, slo_itl_ms=50)
    assert s.completed == 3 and s.errors == 1 and s.first_error == "boom"
    assert s.good_requests == 1 and s.goodput == pytest.approx(0.5)
    assert s.request_throughput == pytest.approx(1.5)
    assert s.input_tokens == 30 and s.output_tokens == 9 and s.output_tokens_per_s == pytest.approx(4.5)
    assert s.ttft_ms.p50 == pytest.approx(100) and s.ttft_ms.mean == pytest.approx(500 / 3, abs=0.01)
    assert s.tpot_ms.p50 == pytest.approx(20) and s.tpot_ms.p99 == pytest.approx(20 + 35 * 0.98, abs=0.01)
    assert s.itl_ms.p50 == pytest.approx(20) and s.itl_ms.p99 == pytest.approx(90 - 0.05 * 70, abs=0.01)
    assert s.e2e_ms.p50 == pytest.approx(210)  # of 140, 340, 210
    only_ttft = summarize(recs, 2.0, w, slo_ttft_ms=200)
    assert only_ttft.good_requests == 2
    assert summarize(recs, 2.0, w).goodput is None
    assert "goodput" in report.format_summary(s) and "TTFT" in report.format_summary(s)
    # TPOT bounds the mean gap, not each one: the slow gap (TPOT 55 ms) passes at 60 ms, fails at 50
    assert summarize(recs, 2.0, w, slo_ttft_ms=200, slo_tpot_ms=60).good_requests == 2
    by_tpot = summarize(recs, 2.0, w, slo_ttft_ms=200, slo_tpot_ms=50)
    assert by_tpot.good_requests == 1 and "TPOT<=50" in report.format_summary(by_tpot)


def test_interference_splits_cohort_gaps_at_the_burst():
    cohort = RequestRecord(ok=True, group="cohort", token_times=[0.0, 0.1, 0.2, 0.3, 0.8, 1.3, 1.4])
    burst = RequestRecord(ok=True, group="burst", start=0.35, latency=1.0)
    i = bench_serve.interference([cohort, burst])
    assert i.cohort_itl_p99_before_ms == pytest.approx(100)
    assert i.cohort_itl_p99_during_ms == pytest.approx(500, abs=0.5)  # gaps ending in [0.35, 1.35]
    assert i.ratio == pytest.approx(5.0, abs=0.01)


def test_cohort_alone_is_the_baseline_of_a_burst_window():
    """--burst 0 sends the cohort alone; its ITL p99 over a burst run's window compares the same stream
    positions (a growing context slows decodes on its own, burst or not)."""
    a = args("http://x", dataset="interference", cohort=3, burst=0, input_len=8, output_len=20)
    w = datasets.build(a)
    assert [s.group for s in w.sessions] == ["cohort"] * 3
    with pytest.raises(InvalidArgumentError, match="--burst must be at least 0"):
        datasets.build(args("http://x", dataset="interference", burst=-1))
    alone = RequestRecord(ok=True, group="cohort", token_times=[0.0, 0.1, 0.2, 0.4, 0.6, 0.9, 1.2])
    assert bench_serve.interference([alone]) is None
    assert bench_serve.cohort_itl_p99_ms([alone], 0.3, 1.0) == pytest.approx(300, abs=2)  # gaps ending at 0.4, 0.6, 0.9
    assert bench_serve.cohort_itl_p99_ms([alone], 0.0, 0.25) == pytest.approx(100)
    assert bench_serve.cohort_itl_p99_ms([alone], 2.0, 3.0) is None


def test_shared_prefix_fraction():
    assert datasets.shared_prefix_fraction([[1, 2, 3, 4], [1, 2, 3, 9], [5, 2, 3, 4]]) == pytest.approx(3 / 12)
    a = args("http://x", dataset="prefix-rag", num_prompts=20, system_len=30, tools_len=10, num_docs=2,
             doc_len=20, question_len=5)
    plain = datasets.build(a)
    assert plain.shared_prefix_fraction > 0.8 and all(len(s.turns[0].prompt) == 65 for s in plain.sessions)
    a.scramble = True
    assert datasets.build(a).shared_prefix_fraction < plain.shared_prefix_fraction


def test_trace_replay_honours_arrival_times_and_caps():
    rows = [TraceRow(100.0, 500, 20), TraceRow(100.1, 30, 900), TraceRow(100.25, 40, 5), TraceRow(100.4, 7, 7)]
    sessions = datasets.trace_sessions(rows, 2.0, max_input_len=64, max_output_len=8, tokens=lambda n: [1] * n)
    assert [s.start for s in sessions] == pytest.approx([0.0, 0.2, 0.5, 0.8])
    assert [(len(s.turns[0].prompt), s.turns[0].max_tokens) for s in sessions] == [(64, 8), (30, 8), (40, 5), (7, 7)]

    async def instant(turn, rec, t0):  # a trivially fast server
        rec.start, rec.ok = time.perf_counter() - t0, True

    records, elapsed = asyncio.run(bench_serve.drive(Workload("t", sessions), instant))
    assert [r.start for r in records] == pytest.approx([0.0, 0.2, 0.5, 0.8], abs=0.1)
    assert 0.8 <= elapsed < 1.5
    shipped = datasets.load_trace("azure-conv")
    assert len(shipped) == 19366 and shipped[1] == TraceRow(4.314579, 396, 109)
    assert len(datasets.load_trace("azure-code")) == 8819


def args(url: str, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_serve.add_args(p)
    a = p.parse_args(["--base-url", url, "--no-progress"])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir):
    client = AsyncEngineClient(KVServeConfig.from_kwargs(model=str(tiny_model_dir), dtype="float32", num_threads=1,
                                            num_kv_blocks=256, max_num_batched_tokens=256))
    with ServerThread(client, ServerConfig(served_model_names=["tiny"])) as server:
        yield server


def _check_tokens(s, workload_args, result_file):
    """Token counts in the summary are the server's usage, and match what was sent."""
    w = datasets.build(workload_args)
    sent_in = sum(len(t.prompt) for x in w.sessions for t in x.turns)
    sent_out = sum(t.max_tokens for x in w.sessions for t in x.turns)
    recs = json.loads(result_file.read_text())["requests"]
    assert all(r["prompt_tokens"] > 0 and r["output_tokens"] > 0 for r in recs)
    assert s.input_tokens == sum(r["prompt_tokens"] for r in recs) == sent_in
    assert s.output_tokens == sum(r["output_tokens"] for r in recs) == sent_out


def test_bench_serve_random_against_kvserve(tiny_server, tmp_path):
    out, jl, png = tmp_path / "r.json", tmp_path / "r.jsonl", tmp_path / "r.png"
    a = args(tiny_server.url, num_prompts=6, input_len=12, output_len=5, max_concurrency=3, save_result=str(out),
             save_records=str(jl), slo_ttft_ms=60_000, slo_itl_ms=60_000)
    plotting = True
    try:
        import matplotlib  # noqa: F401
        a.plot = str(png)
    except ImportError:
        plotting = False
    s = bench_serve.run(a)
    assert s.errors == 0 and s.completed == 6 and s.good_requests == 6
    assert s.output_tokens_per_s > 0 and s.ttft_ms.p50 > 0 and s.itl_ms.p99 >= s.itl_ms.p50
    _check_tokens(s, a, out)
    lines = jl.read_text().splitlines()
    assert len(lines) == 6 and json.loads(lines[0])["output_tokens"] == 5
    if plotting:
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_serve_azure_conv_replay(tiny_server, tmp_path):
    out = tmp_path / "r.json"
    # rows 0..3 arrive over ~9 s; time-scale 0.01 compresses that to ~90 ms
    a = args(tiny_server.url, dataset="azure-conv", num_prompts=4, time_scale=0.01, max_input_len=40,
             max_output_len=4, save_result=str(out))
    s = bench_serve.run(a)
    assert s.errors == 0 and s.completed == 4
    _check_tokens(s, a, out)
    assert s.output_tokens == 16


def test_bench_serve_prefix_rag(tiny_server, tmp_path):
    out = tmp_path / "r.json"
    a = args(tiny_server.url, dataset="prefix-rag", num_prompts=5, system_len=24, tools_len=8, num_docs=2,
             doc_len=16, question_len=6, output_len=3, save_result=str(out))
    s = bench_serve.run(a)
    assert s.errors == 0 and s.completed == 5 and 0.5 < s.shared_prefix_fraction < 1
    _check_tokens(s, a, out)
    # the server's usage reports cached tokens (the module's server is warm from earlier tests, so
    # the rate is not bounded by this run's own shareable part)
    assert s.prefix_hit_rate is not None and 0 < s.prefix_hit_rate <= 1
    # and `bench table` reads the saved result back
    from kvserve.bench import compare

    md = compare.table([f"kv={out}", f"again={out}"])
    assert "| | kv | again |" in md and "prefix cache hits" in md
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        compare.table([f"x={tmp_path / 'missing.json'}"])


def test_bench_serve_multi_turn_waits_for_answers(tiny_server, tmp_path):
    out = tmp_path / "r.json"
    a = args(tiny_server.url, dataset="multi-turn", num_conversations=2, turns=3, user_len=8, answer_len=4,
             save_result=str(out))
    s = bench_serve.run(a)
    assert s.errors == 0 and s.completed == 6
    _check_tokens(s, a, out)
    recs = json.loads(out.read_text())["requests"]
    for prev, nxt in zip(recs, recs[1:]):
        if prev["session"] == nxt["session"]:
            assert nxt["turn"] == prev["turn"] + 1 and nxt["start"] >= prev["start"] + prev["latency"]
            assert nxt["prompt_tokens"] == prev["prompt_tokens"] + 4 + 8


def test_bench_serve_interference_labels_cohort_and_burst(tiny_server, tmp_path):
    out = tmp_path / "r.json"
    # the burst generates 16 tokens so that it spans several of the cohort's steps (with one token it
    # could end, 12 ms on a fast CPU, between two cohort tokens), and the cohort's 300 tokens outlast
    # the burst's delay even at the tiny model's 2.4 ms per token on a fast, quiet CPU
    a = args(tiny_server.url, dataset="interference", cohort=2, input_len=8, output_len=300, burst=1, burst_len=120,
             burst_output_len=16, burst_delay=0.1, save_result=str(out))
    s = bench_serve.run(a)
    assert s.errors == 0 and s.completed == 3 and s.output_tokens == 2 * 300 + 16
    recs = json.loads(out.read_text())["requests"]
    assert [r["group"] for r in recs] == ["cohort", "cohort", "burst"] and recs[2]["start"] >= 0.1
    # the cohort still decodes while the burst runs
    assert s.interference is not None and s.interference.cohort_itl_p99_during_ms is not None


def test_bench_serve_against_dead_endpoint_reports_errors(tmp_path):
    sock = free_socket()  # bound but never listening: connections are refused
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    out = tmp_path / "r.json"
    s = bench_serve.run(args(url, model="x", num_prompts=4, input_len=4, output_len=2, save_result=str(out)))
    sock.close()
    assert s.errors == 4 and s.completed == 0 and "Connect" in s.first_error
    assert json.loads(out.read_text())["summary"]["errors"] == 4
    with pytest.raises(KVServeError, match="cannot list models"):  # no --model: a one-line error, not a traceback
        bench_serve.run(args(url, num_prompts=1, input_len=4, output_len=2))


def test_bench_compare_runs_each_server_and_writes_markdown(tiny_server, tmp_path):
    from kvserve.bench import compare

    p = argparse.ArgumentParser()
    compare.add_args(p)
    md = tmp_path / "c.md"
    a = p.parse_args(["--servers", f"a={tiny_server.url},b={tiny_server.url}", "--num-prompts", "2", "--input-len", "6",
                      "--output-len", "3", "--output-md", str(md), "--no-progress"])
    s = compare.run(a)
    assert list(s) == ["a", "b"] and all(x.completed == 2 and x.output_tokens == 6 for x in s.values())
    text = md.read_text()
    assert "| | a | b |" in text and "| completed | 2 | 2 |" in text
    with pytest.raises(InvalidArgumentError, match="name=url"):
        compare.parse_servers(["nourl"])


def test_bench_serve_text_prompts(tiny_server, tmp_path, tiny_model_dir):
    """--text-prompts sends strings decoded with the given tokenizer; the server's usage still counts."""
    a = args(tiny_server.url, num_prompts=3, input_len=8, output_len=3, text_prompts=True,
             tokenizer=str(tiny_model_dir))
    s = bench_serve.run(a)
    assert s.errors == 0 and s.completed == 3 and s.output_tokens == 9 and s.input_tokens > 0
