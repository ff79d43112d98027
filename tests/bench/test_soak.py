"""A short soak: mixed traffic against `kvserve serve` on the tiny model with a tight KV pool.

The same code as scripts/soak.py (kvserve/bench/soak/), for ~30 s instead of 20 minutes: every
kind of request is served, nothing fails that should not, every KV block comes back, and the
server is still healthy and stops cleanly. (RSS figures come from the long run; here only a
loose bound.)
"""

from __future__ import annotations

import pytest

from kvserve.bench.soak import MIX, SoakConfig, failed, format_result, soak_with_server

pytest.importorskip("jsonschema")


def test_short_soak_serves_every_kind_without_errors_or_leaks(tiny_model_dir, tmp_path):
    # 40 blocks of 16 tokens hold ~3 of the 8 concurrent sequences: preemptions happen too
    serve_args = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "40", "--max-num-seqs", "8"]
    cfg = SoakConfig(url="", duration=30, concurrency=8, seed=1, sample_interval=1.0, request_timeout=90,
                     mix={**MIX, "bad": 1.5})
    r = soak_with_server(cfg, str(tiny_model_dir), serve_args, log_path=str(tmp_path / "server.log"),
                         progress=False)
    report = format_result(r)
    print(report)
    assert not failed(r), report
    assert r["unexplained_errors"] == 0 and r["leaked_blocks"] == 0, report
    assert r["healthy_at_end"] and r["server_alive_at_end"] and r["server_exit_code"] == 0, report
    assert not r["server_log_errors"], report
    kinds = r["by_kind"]
    for kind in ("completion", "completion_stream", "chat", "chat_stream"):
        assert kinds.get(kind, {}).get("ok", 0) >= 3, report
    assert kinds.get("json", {}).get("ok", 0) >= 1, report
    for kind in ("abort_mid_stream", "abort_early"):
        assert kinds.get(kind, {}).get("ok", 0) + kinds.get(kind, {}).get("aborted", 0) >= 1, report
    assert kinds.get("bad", {}).get("expected_error", 0) >= 1, report
    assert r["preemptions"] >= 1, report
    assert r["prefix_cache_hit_rate"] > 0, report
    for key in ("server_rss", "engine_rss"):  # sampled; a sanity bound only
        assert r[key] is not None and r[key]["max_mib"] < 8192, report
