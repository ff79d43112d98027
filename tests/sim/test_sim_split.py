"""The simulator's disaggregated prefill (kvserve/sim/cluster.py) and ``kvserve plan --split``: each
replica is the engine's own scheduler on a clock of its own; a prompt's KV crosses the KV link (its
latency and bandwidth delay the decode side by exactly what they say); a decode replica restores every
full block it was sent and computes only the rest; bursts of long prompts stall a colocated replica's
streams but not a split's; the planner compares every layout of the devices."""

from __future__ import annotations

import pytest

from kvserve.bench.datasets import Session, Turn, Workload
from kvserve.errors import InvalidArgumentError
from kvserve.sim import planner
from kvserve.sim.cluster import KVLink, Layout, simulate_cluster
from kvserve.sim.hardware import get_hardware
from kvserve.sim.models import get_model
from kvserve.sim.profiles import get_profile
from kvserve.sim.split_plan import plan_split, report

M, HW, PROF = get_model("llama-3.1-8b"), get_hardware("h100-sxm"), get_profile("vllm")
PROMPT = 1000  # 62 full 16-token blocks and 8 tokens


def one_request(link: KVLink, layout: Layout = Layout(1, 1)):
    wl = Workload("one", [Session([Turn(list(range(5, 5 + PROMPT)), 8)], start=0.0)])
    return simulate_cluster(wl, M, HW, PROF, layout, link=link)


def gap(run) -> float:
    """From the first token (the prefill replica's) to the second (the decode replica's)."""
    times = run.records[0].token_times
    assert len(times) == 8
    return times[1] - times[0]


def test_the_transfer_costs_its_latency_and_bytes():
    fast = one_request(KVLink(((1e6, 0.0),)))
    slow_latency = one_request(KVLink(((1e6, 0.5), (1e6, 0.25))))  # hops' latencies add up
    kv_bytes = 62 * 16 * M.kv_bytes_per_token(PROF.kv)
    narrow = one_request(KVLink(((kv_bytes / 1e9, 0.0), (1e6, 0.0))))  # the slowest hop: one second for the prompt
    assert gap(slow_latency) - gap(fast) == pytest.approx(0.75, abs=1e-6)
    assert gap(narrow) - gap(fast) == pytest.approx(1.0, abs=1e-3)
    # TTFT is the prefill replica's alone
    assert fast.records[0].token_times[0] == slow_latency.records[0].token_times[0] == narrow.records[0].token_times[0]


def test_decode_replica_restores_what_was_sent_and_computes_only_the_rest():
    split = one_request(KVLink.of(HW))
    assert split.result.prefix_hit_rate == pytest.approx(62 * 16 / PROMPT)  # every full block came over
    assert split.prompt_tokens == {"prefill": PROMPT, "decode": PROMPT + 1 - 62 * 16}  # the tail and the first token
    colocated = one_request(KVLink.of(HW), Layout(0, 1))
    assert colocated.prompt_tokens == {"both": PROMPT} and colocated.result.prefix_hit_rate == 0


def test_requests_spread_over_each_pool():
    wl = planner.make_workload("random", num_prompts=16, input_len=600, output_len=16)
    run = simulate_cluster(wl, M, HW, PROF, Layout(2, 3), request_rate=50.0)
    assert run.result.completed == 16 and run.result.devices == 5
    assert run.prompt_tokens["prefill"] == 16 * 600
    assert run.prompt_tokens["decode"] == 16 * (600 - 37 * 16 + 1)


def test_bursts_of_long_prompts_stall_colocated_streams_but_not_a_split():
    wl = planner.make_workload("interference", cohort=16, input_len=256, output_len=64, burst=4, burst_len=16000,
                               burst_output_len=1, burst_delay=0.2)
    colocated = simulate_cluster(wl, M, HW, PROF, Layout(0, 2)).result
    split = simulate_cluster(wl, M, HW, PROF, Layout(1, 1)).result
    assert colocated.itl_ms.p99 > 3 * split.itl_ms.p99  # a burst's chunks land in the streams' steps
    assert split.itl_ms.p99 < 2 * split.itl_ms.p50


def test_plan_split_compares_every_layout():
    plan = plan_split("h100-sxm", 2, "llama-3.1-8b", "random", weights=None, kv=None, slo_ttft_ms=2000,
                      slo_tpot_ms=40, num_prompts=40, input_len=800, output_len=32)
    assert [r.layout.name for r in plan.rows] == ["colocated x2", "split 1P+1D"]
    assert plan.best in plan.rows and all(r.goodput > 0 for r in plan.rows)
    assert plan.best.goodput == max(r.goodput for r in plan.rows)
    assert any(line.startswith("\nanswer: ") for line in report(plan))


def test_bad_kv_link_is_a_clear_error():
    assert KVLink.of(HW, "450:5,50:10").hops == ((450.0, 5e-6), (50.0, 10e-6))
    assert KVLink.of(HW).hops == ((HW.interconnect_gbps, HW.kv_link_latency_s),)
    for bad in ("fast", "0:5", "450:-1", "450:x"):
        with pytest.raises(InvalidArgumentError, match="--kv-link"):
            KVLink.of(HW, bad)
