"""The benchmarks' arithmetic and the serving benchmark against a live and a dead server."""

import argparse

import pytest

from kvserve.bench import serve as bench_serve
from kvserve.bench.offline import percentile
from kvserve.bench.serve import RequestRecord
from kvserve.config import EngineConfig
from kvserve.engine.process import AsyncEngineClient
from kvserve.server.api import ServerConfig
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


def args(url: str, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_serve.add_args(p)
    a = p.parse_args(["--base-url", url])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_bench_serve_against_kvserve_counts_tokens(tiny_model_dir, tmp_path):
    client = AsyncEngineClient(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_threads=1,
                                            num_kv_blocks=256, max_num_batched_tokens=256))
    with ServerThread(client, ServerConfig(served_model_names=["tiny"])) as server:
        out = tmp_path / "r.json"
        s = bench_serve.run(args(server.url, num_prompts=6, input_len=12, output_len=5, max_concurrency=3,
                                 save_result=str(out)))
    assert s["errors"] == 0 and s["completed"] == 6
    assert s["output_tokens_per_s"] > 0 and s["ttft_ms"]["p50"] > 0 and s["itl_ms"]["p99"] >= s["itl_ms"]["p50"]
    assert out.exists()
    assert s["input_tokens_per_s"] * s["elapsed_s"] == pytest.approx(6 * 12, rel=0.01)


def test_bench_serve_against_dead_endpoint_reports_errors(tmp_path):
    sock = free_socket()  # bound but never listening: connections are refused
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    out = tmp_path / "r.json"
    s = bench_serve.run(args(url, model="x", num_prompts=4, input_len=4, output_len=2, save_result=str(out)))
    sock.close()
    assert s["errors"] == 4 and s["completed"] == 0 and "Connect" in s["first_error"]
    assert out.exists()
