"""Per-engine GPU cost terms, the validation against published measurements, and the simulator's
rough edges (warnings, bursts, footprint on several GPUs, plan's reasons)."""

import json
import logging
from pathlib import Path

import pytest

from kvserve.engine.request import SamplingParams
from kvserve.kv.manager import KVTransfer
from kvserve.sim import planner, validate
from kvserve.sim.cost_model import ChunkShape, Roofline
from kvserve.sim.engine_costs import ENGINE_COSTS, EngineCosts, costs_for, load_fitted
from kvserve.sim.hardware import get_hardware
from kvserve.sim.models import PRESETS
from kvserve.sim.planner import make_workload
from kvserve.sim.profiles import get_profile
from kvserve.sim.simulate import build_sim_engine, simulate

M8B, H100 = PRESETS["llama-3.1-8b"], get_hardware("h100-sxm")
PLAIN = EngineCosts(host_step_s=0.003, host_per_seq_s=0.0, graph_sizes=(1, 2, 4, 8, 16), gemm_half_tokens=0.0,
                    attn_half_kv_tokens=0.0, interference=0.0)
RESULTS = Path(__file__).parents[2] / "docs" / "results" / "2026-12-03-s20-simgpu" / "validation.json"


def decode(n: int, ctx: int = 1000) -> list[ChunkShape]:
    return [ChunkShape(ctx, 1, True, decode=True)] * n


def test_host_time_adds_unless_the_engine_overlaps_it():
    serial = Roofline(M8B, H100, costs=PLAIN).step(decode(8))
    overlapped = Roofline(M8B, H100, costs=PLAIN.with_(overlap_host=True)).step(decode(8))
    gpu = serial.launch_s + max(serial.compute_s, serial.memory_s)
    assert serial.host_s == pytest.approx(0.003)
    assert serial.seconds == pytest.approx(gpu + 0.003)
    assert overlapped.seconds == pytest.approx(max(gpu, 0.003))
    # vLLM schedules between steps, SGLang and TensorRT-LLM overlap: the profiles say so
    assert not ENGINE_COSTS["vllm"].overlap_host and ENGINE_COSTS["sglang"].overlap_host
    assert ENGINE_COSTS["trtllm"].overlap_host


def test_cuda_graph_sizes_pad_decode_and_eager_steps_launch_per_layer():
    rf = Roofline(M8B, H100, costs=PLAIN)
    eight, nine, big = rf.step(decode(8)), rf.step(decode(9)), rf.step(decode(17))
    assert eight.graph_batch == 8 and nine.graph_batch == 16 and big.graph_batch is None
    assert eight.launch_s == PLAIN.launch_graph_s
    assert big.launch_s == pytest.approx(PLAIN.launch_eager_per_layer_s * M8B.layers)
    # a 9-sequence step computes 16 rows in its padded graph; a prefill never uses a graph
    assert nine.compute_s / eight.compute_s > 1.9
    assert rf.step([ChunkShape(0, 512, True)]).graph_batch is None
    assert ENGINE_COSTS["sglang"].graph_batch(200) == 200 and ENGINE_COSTS["sglang"].graph_batch(300) is None
    assert ENGINE_COSTS["vllm"].graph_batch(300) == 304 and ENGINE_COSTS["trtllm"].graph_batch(3000) == 4096


def test_gemm_efficiency_grows_with_tokens():
    costs = PLAIN.with_(gemm_half_tokens=256.0)
    rf = Roofline(M8B, H100, costs=costs)
    small, large = rf.step([ChunkShape(0, 64, False)]), rf.step([ChunkShape(0, 8192, False)])
    per_small = small.compute_s / small.linear_flops
    per_large = large.compute_s / large.linear_flops
    assert per_small / per_large > 3  # 64 tokens reach 64/320 of the MFU, 8192 tokens 8192/8448
    assert costs.gemm_efficiency(256) == pytest.approx(0.5)


def test_attention_efficiency_depends_on_the_kv_a_step_reads():
    costs = PLAIN.with_(attn_half_kv_tokens=4096.0)
    rf, flat = Roofline(M8B, H100, costs=costs), Roofline(M8B, H100, costs=PLAIN)
    # one short context: KV read at a quarter of the bandwidth (1024 / (1024 + 4096) ~ 0.2)
    short = rf.step(decode(1, 1023)).memory_s - flat.step(decode(1, 1023)).memory_s
    long = rf.step(decode(16, 32767)).memory_s - flat.step(decode(16, 32767)).memory_s
    kvb = M8B.kv_bytes_per_token("bf16")
    assert short / (1024 * kvb) > long / (16 * 32768 * kvb)
    assert costs.kv_efficiency(4096) == pytest.approx(0.5)


def test_mixed_prefill_decode_steps_pay_interference():
    costs = PLAIN.with_(interference=0.5)
    mixed = decode(32) + [ChunkShape(0, 2048, True)]
    a, b = Roofline(M8B, H100, costs=costs).step(mixed), Roofline(M8B, H100, costs=PLAIN).step(mixed)
    assert a.seconds - b.seconds == pytest.approx(0.5 * min(a.compute_s, a.memory_s))
    pure = decode(32)
    assert Roofline(M8B, H100, costs=costs).step(pure).seconds == Roofline(M8B, H100, costs=PLAIN).step(pure).seconds


def test_cpu_entry_keeps_its_calibrated_flat_terms():
    cpu = get_hardware("cpu")
    chunks = [ChunkShape(0, 10, True)]
    assert Roofline(PRESETS["smollm2-135m"], cpu, costs=PLAIN).step(chunks).seconds == \
        Roofline(PRESETS["smollm2-135m"], cpu).step(chunks).seconds


def test_vllm_and_sglang_differ_without_shared_prefixes():
    wl = make_workload("random", num_prompts=48, input_len=256, output_len=48)
    v = simulate(wl, M8B, H100, get_profile("vllm"), max_concurrency=16)
    s = simulate(wl, M8B, H100, get_profile("sglang"), max_concurrency=16)
    assert v.prefix_hit_rate == s.prefix_hit_rate == 0.0
    assert s.itl_ms.p50 < v.itl_ms.p50  # SGLang hides its host time behind the GPU


def test_fitted_terms_are_applied():
    fitted = {"vllm": {"gemm_scale": 0.5, "host_step_s": 0.001}}
    c = costs_for("vllm", fitted)
    assert c.gemm_scale == 0.5 and c.host_step_s == 0.001 and c.graph_sizes == ENGINE_COSTS["vllm"].graph_sizes
    committed = load_fitted()
    assert set(committed) >= {"vllm", "sglang", "trtllm"}
    assert costs_for("trtllm").gemm_scale == committed["trtllm"]["gemm_scale"]


def test_validation_data_covers_engines_gpus_models_and_concurrency():
    pts = [p for p in validate.load_points() if p["use"]]
    assert len(pts) >= 30
    assert {p["engine"] for p in pts} == {"vllm", "sglang", "trtllm"}
    assert len({p["hardware"] for p in pts}) >= 2 and {p["model"] for p in pts} >= {"llama-3.1-8b", "llama-3.1-70b"}
    conc = [p["load"].get("concurrency") for p in pts]
    assert 1 in conc and max(c for c in conc if c) >= 250 and None in conc  # None: offline, all at once
    for p in pts:
        assert p["source"].startswith("https://") and p["where"] and p["value"] > 0
    fit, held = validate.split(validate.load_points())
    assert not {p["id"] for p in fit} & {p["id"] for p in held} and len(fit) + len(held) == len(pts)
    # each engine has a curve: one setting measured at several concurrencies (or batch sizes)
    for engine in ("vllm", "sglang", "trtllm"):
        levels: dict[str, set] = {}
        for p in pts:
            if p["engine"] == engine:
                key = f"{p['hardware']} {p['model']} {p['tp']} {p['workload'].get('input_len')} {p['metric']}"
                levels.setdefault(key, set()).add(p["load"].get("concurrency") or p["workload"]["num_prompts"])
        assert max(len(v) for v in levels.values()) >= 3, engine


def test_random_lengths_follow_the_benchmark():
    """bench_serving's random dataset draws lengths uniformly up to the given ones (range ratio 0)."""
    p = {"id": "x-output_tok_s", "engine": "sglang", "hardware": "h100-sxm", "model": "llama-3.1-8b", "tp": 1,
         "weights": "bf16", "kv": "bf16", "metric": "output_tok_s", "value": 1.0,
         "workload": {"kind": "random", "input_len": 1000, "output_len": 400, "range_ratio": 0.0, "num_prompts": 80},
         "load": {"concurrency": 16}}
    wl, rate, conc = validate.workload_for(p)
    ins = [len(s.turns[0].prompt) for s in wl.sessions]
    outs = [s.turns[0].max_tokens for s in wl.sessions]
    assert conc == 16 and min(ins) >= 1 and max(ins) <= 1000 and 350 < sum(ins) / len(ins) < 650
    assert max(outs) <= 400 and 130 < sum(outs) / len(outs) < 270


# SGLang's cookbook (kvserve/sim/data/validation.json): (input len, prompts) -> its printed
# "Total input tokens" and "Total generated tokens"
COOKBOOK_TOTALS = {(1000, 10): (6101, 4220), (1000, 80): (39668, 40805), (1000, 500): (249831, 252662),
                   (8000, 10): (41941, 4220), (8000, 80): (300020, 41669), (8000, 320): (1273893, 170000)}


def test_seeded_random_runs_reproduce_bench_servings_draws():
    """With its seed, the workload is bench_serving's own: every cookbook run's published token totals
    come out exactly, and each index's prompt is the same conversation cut to that run's length."""
    series = validate.load_series()["sgl-cookbook-70b-a100x8"]
    assert len(series) == len(COOKBOOK_TOTALS)
    for run in series:
        w = run["workload"]
        lengths = validate.bench_serving_lengths(w)
        assert (sum(i for i, _ in lengths), sum(o for _, o in lengths)) == COOKBOOK_TOTALS[(w["input_len"],
                                                                                           w["num_prompts"])]
    a, b = validate.bench_serving_prompt(3, 900), validate.bench_serving_prompt(3, 5000)
    assert b[:900] == a and validate.bench_serving_prompt(4, 900)[:16] != a[:16]
    for p in validate.load_points():  # a point of a series is that run of it
        if "series" in p:
            run = validate.load_series()[p["series"]][p["run"]]
            assert p["workload"] == run["workload"] and p["load"]["concurrency"] == run["load"]["concurrency"]


def test_a_series_runs_on_one_server_and_finds_the_earlier_runs_prompts_cached():
    """Runs sent to one server one after another share its prefix cache: a run whose prompts extend an
    earlier run's is served partly from the cache and gets its first tokens sooner than on a fresh
    server; bench_serving's warm-up request precedes each run."""
    from kvserve.sim.simulate import Run, simulate_runs

    def run(input_len):
        w = {"kind": "random", "input_len": input_len, "output_len": 32, "num_prompts": 12, "seed": 1}
        return {"workload": w, "load": {"concurrency": 4}}

    runs = validate._runs_for(run(1000))
    assert len(runs) == 2 and runs[0].workload.num_requests == 1  # the warm-up, then the run itself
    assert runs[0].workload.sessions[0].turns[0].prompt == runs[1].workload.sessions[0].turns[0].prompt
    fresh = simulate_runs(validate._runs_for(run(4000)), M8B, H100, get_profile("sglang"))[-1]
    series = simulate_runs(validate._runs_for(run(1000)) + validate._runs_for(run(4000)), M8B, H100,
                           get_profile("sglang"))[-1]
    assert fresh.prefix_hit_rate < 0.1 < 0.15 < series.prefix_hit_rate  # fresh: the warm-up request's prompt
    assert series.ttft_ms.mean < 0.95 * fresh.ttft_ms.mean
    assert series.completed == fresh.completed == 12 and series.mean_concurrency <= 4
    assert isinstance(runs[1], Run) and runs[1].warmup_requests == 0  # measured whole, as bench_serving does


def test_held_back_error_stays_within_the_recorded_fit():
    """The committed run of `kvserve sim validate` meets its bound, and re-simulating a few held-back
    points with the committed fitted terms gives the committed values (the fit has not regressed)."""
    doc = json.loads(RESULTS.read_text())
    held = doc["summary"]["held back"]
    assert held["points"] >= 50
    # the goal (median under 15%, no point off by more than 35%) is met
    assert held["median_abs_error"] < validate.GOAL_MEDIAN
    assert held["max_abs_error"] < validate.GOAL_MAX
    rows = {r["id"]: r for r in doc["rows"]}
    pts = {p["id"]: p for p in validate.load_points()}
    assert max(abs(r["error"]) for r in doc["rows"] if r["half"] == "held back") < validate.GOAL_MAX
    cheap = ["nim-70b-h100x2-c1-ttft_mean_ms", "nim-70b-h100x2-c5-itl_mean_ms",
             "sglang-readme-vllm-8b-a100-rps4-tpot_p50_ms", "sglang-readme-sglang-8b-a100-rps8-ttft_p50_ms",
             "sglang-readme-sglang-70b-h100x4-rps4-tpot_p50_ms",
             "rocm-vllm-70b-mi300x8-128-2048-bs8-batch_latency_s"]
    for pid in cheap:
        assert rows[pid]["half"] == "held back"
        assert validate.simulate_point(pts[pid]) == pytest.approx(rows[pid]["simulated"], rel=0.02)


def test_a_burst_reaches_the_scheduler_one_front_end_time_apart():
    """A front end that takes requests one at a time spreads a burst out: with 40 ms a request, 8
    requests sent at once reach the scheduler over 320 ms, so the first token of the first comes
    sooner than when the whole burst is one prefill and the last later; alone, a request pays the
    front end once; without one, all 8 get their first tokens together."""
    wl = make_workload("random", num_prompts=8, input_len=500, output_len=4)  # one step holds all 8
    prof = get_profile("vllm").with_(costs_override=PLAIN)
    spread = prof.with_(costs_override=PLAIN.with_(frontend_per_request_s=0.04))
    burst = simulate(wl, M8B, H100, prof, max_concurrency=8)
    spaced = simulate(wl, M8B, H100, spread, max_concurrency=8)
    assert burst.ttft_ms.p50 == pytest.approx(burst.ttft_ms.p99, rel=0.05)  # one wave
    assert spaced.ttft_ms.p99 > 8 * 40 > spaced.ttft_ms.p50 > 40
    one = make_workload("random", num_prompts=1, input_len=500, output_len=4)
    alone = simulate(one, M8B, H100, prof, max_concurrency=1).ttft_ms.mean
    assert simulate(one, M8B, H100, spread, max_concurrency=1).ttft_ms.mean == pytest.approx(alone + 40, rel=0.02)
    assert ENGINE_COSTS["sglang"].frontend_per_request_s > 0 and ENGINE_COSTS["vllm"].frontend_per_request_s == 0


def test_closed_loop_is_measured_after_its_warm_up():
    """A closed loop started all at once queues its first wave's prompts behind each other; measured
    after c warm-up requests its TTFT is the steady state's, and its rate is c / end-to-end time."""
    c = 16
    wl = make_workload("random", num_prompts=3 * c, input_len=4000, output_len=200)
    cold = simulate(wl, M8B, H100, get_profile("vllm"), max_concurrency=c)
    warm = simulate(wl, M8B, H100, get_profile("vllm"), max_concurrency=c, warmup_requests=c)
    assert warm.ttft_ms.mean < 0.6 * cold.ttft_ms.mean
    assert warm.steady_output_tokens_per_s == pytest.approx(c * 200 / (warm.e2e_ms.mean / 1000), rel=0.01)
    assert validate.metric(warm, "output_tok_s") == warm.steady_output_tokens_per_s


def test_an_overlap_scheduler_admits_a_request_one_step_later():
    """SGLang forms step n+1 while step n runs, so a request sent during step n joins step n+2: with
    host time zero (steps cost the same either way) only the admission differs."""
    wl = make_workload("random", num_prompts=40, input_len=200, output_len=100)
    no_host = PLAIN.with_(host_step_s=0.0)
    runs = {}
    for overlap in (False, True):
        prof = get_profile("vllm").with_(costs_override=no_host.with_(overlap_host=overlap, late_admission=overlap))
        runs[overlap] = simulate(wl, M8B, H100, prof, request_rate=20.0)
    step = runs[False].itl_ms.p50
    assert runs[True].ttft_ms.mean > runs[False].ttft_ms.mean + 0.5 * step
    assert runs[True].itl_ms.p50 == pytest.approx(step, rel=0.05)
    assert ENGINE_COSTS["sglang"].late_admission and not ENGINE_COSTS["vllm"].late_admission


def test_trtllm_sizes_its_kv_cache_from_the_memory_left_after_weights():
    from kvserve.sim.simulate import footprint

    m70, trt = PRESETS["llama-3.1-70b"], get_profile("trtllm")
    free = footprint(m70, trt, H100, tp=2)
    total = footprint(m70, trt.with_(kv_memory_of_free=False), H100, tp=2)
    assert free.kv_budget_gb == pytest.approx((2 * H100.hbm_gb - free.fixed_gb) * 0.9)
    assert free.kv_budget_gb > total.kv_budget_gb + 5  # 0.9 of the free 89 GB, not 0.9 x 160 less 71 GB
    assert not get_profile("vllm").kv_memory_of_free and not get_profile("sglang").kv_memory_of_free


def test_sim_keeps_the_engines_preemption_advice_to_itself(caplog):
    wl = make_workload("random", num_prompts=16, input_len=200, output_len=400)
    with caplog.at_level(logging.WARNING):
        r = simulate(wl, M8B, H100, get_profile("vllm"), num_kv_blocks=100)
    assert r.preemptions > 0
    assert not [rec for rec in caplog.records if "max-num-seqs" in rec.getMessage()]
    assert logging.getLogger("kvserve.engine.scheduler").level == logging.NOTSET  # restored


def test_host_tier_saves_overlap_the_step_and_loads_do_not():
    engine, runner, _ = build_sim_engine(M8B, H100, get_profile("sglang"), num_kv_blocks=400)
    engine.add_request("a", list(range(100, 2100)), SamplingParams(max_tokens=2, ignore_eos=True))
    batch = engine.scheduler.schedule()
    bare = runner.step_seconds(batch)
    batch.kv_transfers = [KVTransfer("save", i) for i in range(4)]
    assert runner.step_seconds(batch) == pytest.approx(bare)  # four blocks copy out while the prefill runs
    batch.kv_transfers = [KVTransfer("load", i) for i in range(4)]
    assert runner.step_seconds(batch) == pytest.approx(bare + runner.roofline.transfer_seconds(4 * runner.block_bytes))


def test_footprint_on_several_gpus_and_the_cli_says_how_many(capsys):
    one = planner.hbm_footprint_gb(70, 70, 8192, "vllm")
    assert one.sequences_that_fit == 0 and one.devices_needed == 2
    two = planner.hbm_footprint_gb(70, 70, 8192, "vllm", tp=2)
    assert two.sequences_that_fit > 0 and two.tp == 2
    from kvserve.cli import main

    assert main(["sim", "footprint", "--params-b", "70", "--stacks", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "does not fit on one h100-sxm" in out and "--tp 2" in out
    assert main(["sim", "footprint", "--params-b", "70", "--stacks", "vllm", "--gpus", "2"]) == 0
    assert "does not fit" not in capsys.readouterr().out


def test_plan_states_its_slos_and_why_each_engine_got_its_gpus():
    pick = planner.pick_engine("h100-sxm", 4, "batch", "llama-3.1-70b", num_prompts=16, input_len=256,
                               output_len=16)
    assert "TTFT p99 <=" in pick.comparison.question
    assert any("trtllm" in r and "TP=2" in r and "fp8 weights" in r for r in pick.reasons)
    assert any(r.startswith("vllm") and "TP=4" in r and "bf16 weights" in r for r in pick.reasons)


def test_batching_compares_chunking_on_bursts_of_long_prompts():
    wl = make_workload("interference", **planner.BURSTS)
    m = PRESETS["llama-3.1-8b"]
    vllm = get_profile("vllm")
    whole = simulate(wl, m, H100, vllm.with_(chunked_prefill=False, max_num_batched_tokens=m.max_context))
    chunked = simulate(wl, m, H100, vllm)
    assert whole.itl_ms.p99 > 1.5 * chunked.itl_ms.p99


def test_trace_description_names_only_the_caps_it_has():
    assert "None" not in make_workload("azure-conv", num_prompts=5).description  # the plot title of `sim run`
    assert "input <= 8000" in make_workload("chat", num_prompts=5).description
