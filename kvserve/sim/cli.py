"""``kvserve sim ...`` and ``kvserve plan``: the simulator's questions on the command line."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from kvserve import progress
from kvserve.bench import datasets
from kvserve.errors import InvalidArgumentError
from kvserve.sim import planner
from kvserve.sim.hardware import get_hardware, load_catalog
from kvserve.sim.models import KV_DTYPES, get_model
from kvserve.sim.profiles import PROFILES, get_profile
from kvserve.sim.simulate import SimResult, simulate


def results_table(results: dict[str, SimResult], utilization: float = 0.7) -> str:
    head = ("| | devices | out tok/s | req/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) "
            "| TPOT p50 (ms) | prefix hits | preemptions | $/1M out tok |")
    rows = [head, "|---|" + "---:|" * 11]

    def d(x, q):
        return "-" if x is None else f"{getattr(x, q):.1f}"

    for k, r in results.items():
        rows.append(f"| {k} | {r.devices} | {r.output_tokens_per_s:.1f} | {r.request_throughput:.2f} | "
                    f"{d(r.ttft_ms, 'p50')} | {d(r.ttft_ms, 'p99')} | {d(r.itl_ms, 'p50')} | {d(r.itl_ms, 'p99')} | "
                    f"{d(r.tpot_ms, 'p50')} | "
                    f"{r.prefix_hit_rate:.1%} | {r.preemptions} | {r.cost_per_million_output_tokens(utilization):.3f} |")
    return "\n".join(rows)


def _print_comparison(c: planner.Comparison, plot: str | None) -> None:
    print(c.question)
    print(results_table(c.results))
    for n in c.notes:
        print(f"- {n}")
    if plot:
        _plot(c, plot)


def _plot(c: planner.Comparison, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(c.results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    axes[0].barh(names, [r.output_tokens_per_s for r in c.results.values()])
    axes[0].set_xlabel("output tokens/s")
    axes[1].barh(names, [r.ttft_ms.p99 / 1e3 if r.ttft_ms else 0 for r in c.results.values()])
    axes[1].set_xlabel("TTFT p99 (s)")
    fig.suptitle(c.question, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _bar_plot(labels: list[str], values: list[float], xlabel: str, title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.4 * len(labels) + 1.2))
    ax.barh(labels, values)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3.1-8b", help="a preset or a path to a Hugging Face config.json")
    p.add_argument("--hardware", default="h100-sxm", help=f"one of the catalog's: {', '.join(load_catalog())}")
    p.add_argument("--plot", default=None, help="write a PNG here")


def _with_progress(desc: str, func: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], Any]:
    """``func`` with a progress bar (requests simulated or measured) on stderr while it is a terminal."""

    def run(a: argparse.Namespace) -> Any:
        with progress.task(desc, unit="req"):
            return func(a)

    return run


def add_parsers(sub) -> None:
    sim = sub.add_parser("sim", help="simulate the engine's scheduler on hardware you do not have")
    ss = sim.add_subparsers(dest="sim_command", required=True)

    run = ss.add_parser("run", help="one workload, one or more engine profiles")
    _common(run)
    datasets.add_args(run)
    run.add_argument("--profiles", nargs="+", default=["vllm"], choices=list(PROFILES))
    run.add_argument("--tp", type=int, default=1)
    run.add_argument("--weights", choices=["bf16", "fp8", "fp4", "fp32"], default=None, help="override the profile's")
    run.add_argument("--kv", choices=list(KV_DTYPES), default=None, help="KV cache precision (fp8, int8: what "
                     "--kv-cache-dtype stores)")
    run.add_argument("--num-kv-blocks", type=int, default=None, help="device KV budget in 16-token blocks")
    run.add_argument("--host-tier-gb", type=float, default=0.0)
    run.add_argument("--request-rate", type=float, default=float("inf"))
    run.add_argument("--max-concurrency", type=int, default=None)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--save-result", default=None, help="JSON of every profile's result")
    run.set_defaults(func=_with_progress("simulating", _cmd_run))

    b = ss.add_parser("batching", help="static vs continuous batching, with and without chunked prefill")
    _common(b)
    b.add_argument("--workload", default="chat")
    b.add_argument("--request-rate", type=float, default=8.0)
    b.set_defaults(func=_with_progress("simulating", lambda a: _print_comparison(
        planner.static_vs_continuous(a.model, a.hardware, a.request_rate, a.workload), a.plot)))

    ca = ss.add_parser("cache-aware", help="fcfs vs lpm vs dfs-weight on RAG and scrambled RAG, tight KV")
    _common(ca)
    ca.add_argument("--kv-tokens", type=int, default=20_000)
    ca.add_argument("--request-rate", type=float, default=20.0)
    ca.set_defaults(func=_with_progress("simulating", lambda a: _print_comparison(
        planner.cache_aware_vs_fcfs(a.model, a.hardware, a.kv_tokens, a.request_rate), a.plot)))

    off = ss.add_parser("offload", help="host-tier offload vs recompute under device-memory pressure")
    _common(off)
    off.add_argument("--kv-tokens", type=int, default=40_000)
    off.add_argument("--host-gb", type=float, default=64.0)
    off.set_defaults(func=_with_progress("simulating", lambda a: _print_comparison(
        planner.offload_vs_recompute(a.model, a.hardware, a.kv_tokens, a.host_gb), a.plot)))

    fp = ss.add_parser("footprint", help="device memory per stack: weights + KV + activations + draft")
    fp.add_argument("--params-b", type=float, required=True)
    fp.add_argument("--active-b", type=float, default=None)
    fp.add_argument("--seq-len", type=int, default=8192)
    fp.add_argument("--hardware", default="h100-sxm")
    fp.add_argument("--tp", "--gpus", dest="tp", type=int, default=1, help="devices holding one replica")
    fp.add_argument("--stacks", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    fp.add_argument("--plot", default=None, help="write a PNG here")
    fp.set_defaults(func=_cmd_footprint)

    cost = ss.add_parser("cost", help="USD per million output tokens per stack")
    cost.add_argument("--active-b", type=float, required=True)
    cost.add_argument("--params-b", type=float, default=None)
    cost.add_argument("--hardware", default="h100-sxm")
    cost.add_argument("--tp", "--gpus", dest="tp", type=int, default=1, help="devices holding one replica")
    cost.add_argument("--utilization", type=float, default=0.7)
    cost.add_argument("--workload", default="chat")
    cost.add_argument("--stacks", nargs="+", default=["vllm", "sglang", "trtllm", "llamacpp", "static"],
                      choices=list(PROFILES))
    cost.add_argument("--plot", default=None, help="write a PNG here")
    cost.set_defaults(func=_with_progress("simulating", _cmd_cost))

    from kvserve.sim import calibrate

    cal = ss.add_parser("calibrate", help="measure kvserve's steps on this CPU, fit the 'cpu' entry, "
                                          "and compare simulated with measured at concurrency 1/4/16/64")
    calibrate.add_args(cal)
    cal.set_defaults(func=_with_progress("calibrating", calibrate.run))

    val = ss.add_parser("validate", help="simulated vs published GPU measurements (vLLM, SGLang, TensorRT-LLM)")
    val.add_argument("--fit", action="store_true", help="refit the free cost terms on the fit half first")
    val.add_argument("--output", default=None, help="write every point's published and simulated value (JSON)")
    val.add_argument("--plot", default=None, help="write a PNG of simulated vs published throughput")
    val.set_defaults(func=_cmd_validate)

    plan = sub.add_parser("plan", help="which engine for this hardware, scale and workload, and why")
    plan.add_argument("--hardware", default="h100-sxm")
    plan.add_argument("--gpus", type=int, default=1, help="devices available (the scale)")
    plan.add_argument("--workload", default="chat", help=f"one of {', '.join(planner.WORKLOADS)}")
    plan.add_argument("--model", default="llama-3.1-8b")
    plan.add_argument("--slo-ttft-p99-ms", type=float, default=2000.0)
    plan.add_argument("--slo-itl-p50-ms", type=float, default=50.0)
    plan.add_argument("--tp", type=int, default=None,
                      help="devices per replica (default: per engine, the fewest that hold the model)")
    plan.add_argument("--plot", default=None, help="write a PNG here")
    g = plan.add_argument_group("--split: colocated or disaggregated prefill, and how many of each (goodput)")
    g.add_argument("--split", action="store_true", help="answer 'split or not, how many prefill and decode "
                   "replicas' instead of 'which engine'")
    g.add_argument("--profile", default="vllm", choices=list(PROFILES), help="the engine (default: %(default)s)")
    g.add_argument("--weights", choices=["bf16", "fp8", "fp4", "fp32"], default="fp8")
    g.add_argument("--kv", choices=list(KV_DTYPES), default="fp8")
    g.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="TTFT SLO per request (default: %(default)s)")
    g.add_argument("--slo-tpot-ms", type=float, default=50.0, help="TPOT SLO per request (default: %(default)s)")
    g.add_argument("--kv-link", default=None, metavar="GBPS:US,...",
                   help="the KV's path between replicas per device, a hop each (GB/s and microseconds), e.g. "
                        "450:5 within an NVLink node, 450:5,50:10 across nodes (default: the device's KV link)")
    g.add_argument("--num-prompts", type=int, default=None, help="requests of the workload (default: its own)")
    plan.set_defaults(func=_with_progress("simulating", _cmd_plan))


def _cmd_run(a: argparse.Namespace) -> None:
    m, hw = get_model(a.model), get_hardware(a.hardware)
    wl = datasets.build(a)
    results = {}
    for name in a.profiles:
        prof = get_profile(name)
        if a.weights:
            prof = prof.with_(weights=a.weights)
        if a.kv:
            prof = prof.with_(kv=a.kv)
        results[name] = simulate(wl, m, hw, prof, tp=a.tp, request_rate=a.request_rate,
                                 max_concurrency=a.max_concurrency, seed=a.seed, num_kv_blocks=a.num_kv_blocks,
                                 host_tier_gb=a.host_tier_gb)
    print(f"{wl.description}: {m.name} on {a.tp} x {hw.name}")
    print(results_table(results))
    if a.save_result:
        with open(a.save_result, "w") as f:
            json.dump({k: asdict(r) for k, r in results.items()}, f, indent=1)
    if a.plot:
        _plot(planner.Comparison(wl.description, results), a.plot)


def _cmd_footprint(a: argparse.Namespace) -> None:
    active = a.active_b or a.params_b
    where = f"{a.tp} x {a.hardware}" if a.tp > 1 else f"one {a.hardware}"
    print(f"{a.params_b:g}B parameters ({active:g}B active), {a.seq_len}-token sequences, {where}")
    print("| stack | weights GB | KV GB / seq | activations GB | draft GB | total, 1 seq | seqs that fit "
          "| devices needed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    fits, short = [], []
    for s in a.stacks:
        r = planner.hbm_footprint_gb(a.params_b, active, a.seq_len, s, a.hardware, tp=a.tp)
        fits.append(r.sequences_that_fit)
        need = "-" if r.devices_needed is None else str(r.devices_needed)
        print(f"| {s} | {r.weights_gb:.2f} | {r.kv_gb_per_sequence:.3f} | {r.activations_gb:.2f} | {r.draft_gb:.2f} "
              f"| {r.total_gb_one_sequence:.2f} | {r.sequences_that_fit} | {need} |")
        if r.sequences_that_fit == 0:
            short.append(f"{s} needs {need} x {a.hardware} (--tp {need})" if r.devices_needed
                         else f"{s} does not fit on up to 64 x {a.hardware}")
    for line in short:
        print(f"- does not fit on {where}: {line}")
    if a.plot:
        _bar_plot(a.stacks, fits, f"{a.seq_len}-token sequences that fit", f"{a.params_b:g}B on {where}", a.plot)


def _cmd_cost(a: argparse.Namespace) -> None:
    print(f"{a.active_b:g}B active on {a.tp} x {a.hardware}, {a.workload}, {a.utilization:.0%} utilization")
    print("| stack | $ per 1M output tokens |\n|---|---:|")
    costs = []
    for s in a.stacks:
        try:
            c = planner.cost_per_million_tokens(a.active_b, s, a.hardware, a.utilization, a.params_b, a.workload,
                                                tp=a.tp)
        except InvalidArgumentError as e:  # this stack's precision does not fit these devices
            c = float("nan")
            print(f"| {s} | does not fit: {e} |")
        else:
            print(f"| {s} | {c:.4f} |")
        costs.append(c)
    if a.plot:
        _bar_plot(a.stacks, costs, "USD per 1M output tokens", f"{a.active_b:g}B active on {a.hardware}", a.plot)


def _cmd_plan(a: argparse.Namespace) -> None:
    if a.split:
        from kvserve.sim.split_plan import plan_split, report

        extra = {"num_prompts": a.num_prompts} if a.num_prompts else {}
        split = plan_split(a.hardware, a.gpus, a.model, a.workload, a.profile, a.weights, a.kv, a.tp,
                           a.slo_ttft_ms, a.slo_tpot_ms, a.kv_link, **extra)
        print("\n".join(report(split)))
        return
    pick = planner.pick_engine(a.hardware, a.gpus, a.workload, a.model, a.slo_ttft_p99_ms, a.slo_itl_p50_ms, tp=a.tp)
    print(pick.comparison.question)
    print(results_table(pick.comparison.results))
    for n in pick.comparison.notes:
        print(f"- {n}")
    print(f"\npick: {pick.engine}")
    for r in pick.reasons:
        print(f"- {r}")
    if a.plot:
        _plot(pick.comparison, a.plot)


def _cmd_validate(a: argparse.Namespace) -> None:
    from kvserve.sim import validate_report

    validate_report.run(fit=a.fit, output=a.output, plot_path=a.plot)
