"""The planner's questions, each a function over simulations: batching, cache-aware order,
memory footprint, cost per million tokens, host offload, and which engine to pick.

Every answer comes from running the engine's own scheduler and KV manager on a virtual clock
(``kvserve.sim.simulate``) except the footprint, which is arithmetic.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from kvserve.bench import datasets
from kvserve.bench.datasets import Workload
from kvserve.errors import InvalidArgumentError
from kvserve.sim.hardware import Hardware, get_hardware
from kvserve.sim.models import BYTES, PRESETS, ModelSpec, get_model
from kvserve.sim.profiles import EngineProfile, get_profile
from kvserve.sim.simulate import SimResult, footprint, simulate

WORKLOADS = {  # planner names -> bench datasets with their flags
    "chat": dict(dataset="azure-conv", num_prompts=400, max_input_len=8000, max_output_len=1000),
    "code": dict(dataset="azure-code", num_prompts=400, max_input_len=8000, max_output_len=1000),
    "rag": dict(dataset="prefix-rag", num_prompts=200, system_len=1000, tools_len=300, num_docs=16, doc_len=2000,
                question_len=60, output_len=200),
    "agent": dict(dataset="multi-turn", num_conversations=40, turns=8, user_len=200, answer_len=200),
    "batch": dict(dataset="random", num_prompts=512, input_len=1024, output_len=256),
}


def make_workload(name: str, **overrides) -> Workload:
    """A bench dataset by planner name (chat, code, rag, agent, batch) or dataset name, with flag overrides."""
    p = argparse.ArgumentParser()
    datasets.add_args(p)
    a = p.parse_args([])
    a.seed = 0
    spec = dict(WORKLOADS.get(name, {"dataset": name}))
    spec.update(overrides)
    if spec["dataset"] not in datasets.DATASETS:
        raise InvalidArgumentError(f"unknown workload {name!r}; known: {', '.join([*WORKLOADS, *datasets.DATASETS])}")
    for k, v in spec.items():
        setattr(a, k, v)
    return datasets.build(a)


def _at_rate(name: str, rate: float | None, **overrides) -> tuple[Workload, float]:
    """The workload offered at ``rate`` requests/s (None: all at once, for capacity), and the request
    rate to pass to ``simulate``. A trace keeps its own arrival pattern, rescaled in time."""
    spec = dict(WORKLOADS.get(name, {"dataset": name}), **overrides)
    if not spec["dataset"].startswith("azure"):
        return make_workload(name, **overrides), (rate or float("inf"))
    if rate is None:
        return make_workload(name, **overrides, time_scale=0.0), float("inf")
    native = make_workload(name, **overrides)
    starts = [s.start or 0.0 for s in native.sessions]
    span = max(starts) - min(starts) or 1.0
    return make_workload(name, **overrides, time_scale=len(starts) / rate / span), float("inf")


def model_for_params(params_b: float, active_b: float | None = None) -> ModelSpec:
    """A preset of about this size, or a Llama-shaped model built to it (MoE when active < total)."""
    active_b = active_b or params_b
    for m in PRESETS.values():
        if abs(m.total_params / 1e9 - params_b) / params_b < 0.15 and abs(m.active_params / 1e9 - active_b) / active_b < 0.15:
            return m
    layers = 32 if active_b <= 15 else 80
    # a Llama-3 layer (GQA 8:1 heads, MLP 3.5x) holds about 13 hidden^2 parameters
    hidden = max(512, 128 * round(math.sqrt(active_b * 1e9 * 0.95 / (13 * layers)) / 128))
    heads = hidden // 128
    if active_b >= params_b * 0.95:
        return ModelSpec(f"dense-{params_b:g}B", hidden, layers, heads, max(1, heads // 8), 128, int(3.5 * hidden),
                         128256)
    experts, k = 64, 4  # size the experts so that total and active both come out right
    per_expert = (params_b - active_b) * 1e9 / (layers * (experts - k))
    inter = max(64, int(per_expert / (3 * hidden)))
    return ModelSpec(f"moe-{params_b:g}B-A{active_b:g}B", hidden, layers, heads, max(1, heads // 8), 128, inter,
                     128256, experts=experts, experts_per_token=k, expert_intermediate=inter)


# ---------------------------------------------------------------------------------------------- footprint
@dataclass
class FootprintReport:
    stack: str
    hardware: str
    weights_gb: float
    kv_gb_per_sequence: float
    activations_gb: float
    draft_gb: float
    total_gb_one_sequence: float
    sequences_that_fit: int  # at seq_len, on ``tp`` devices (0: the weights alone do not fit)
    tp: int = 1
    devices_needed: int | None = None  # the smallest power-of-two TP that holds weights + one sequence


def hbm_footprint_gb(params_b: float, active_b: float, seq_len: int, stack: str, hardware: str = "h100-sxm",
                     tp: int = 1) -> FootprintReport:
    """Device memory for a model of ``params_b`` (``active_b`` active) billion parameters under a stack's
    precisions: weights + KV of one ``seq_len`` sequence + activations + draft model, and how many
    such sequences fit beside the weights."""
    profile, hw = get_profile(stack), get_hardware(hardware)
    model = model_for_params(params_b, active_b)
    fp = footprint(model, profile, hw, tp, mem_util=1.0)
    weights = params_b * 1e9 * BYTES[profile.weights] / 1e9 if model.name.startswith(("dense", "moe")) else fp.weights_gb
    kv_seq = fp.kv_gb_per_token * seq_len
    free = hw.hbm_gb * tp - weights - fp.activations_gb - fp.draft_gb
    if profile.slots:  # unpaged: every slot reserves a whole context whatever its use
        fits = min(profile.slots, int(free // kv_seq)) if free > 0 else 0
    else:
        fits = int(free // kv_seq) if free > 0 else 0
    total = weights + kv_seq + fp.activations_gb + fp.draft_gb
    need = next((n for n in (1, 2, 4, 8, 16, 32, 64) if hw.hbm_gb * n >= total), None)
    return FootprintReport(stack, hw.key, round(weights, 3), round(kv_seq, 4), round(fp.activations_gb, 3),
                           round(fp.draft_gb, 3), round(total, 3), fits, tp, need)


# --------------------------------------------------------------------------------------- cost per token
def cost_per_million_tokens(active_b: float, stack: str, hardware: str = "h100-sxm", utilization: float = 0.7,
                            params_b: float | None = None, workload: str = "chat", tp: int = 1) -> float:
    """USD per million output tokens: the stack's simulated saturated throughput on ``workload``
    for a model of ``active_b`` billion active parameters on ``tp`` devices, busy ``utilization`` of
    the time (InvalidArgumentError when it does not fit them)."""
    model = model_for_params(params_b or active_b, active_b)
    wl, rate = _at_rate(workload, None)
    res = simulate(wl, model, get_hardware(hardware), get_profile(stack), tp=tp, request_rate=rate)
    return res.cost_per_million_output_tokens(utilization)


# ----------------------------------------------------------------------------------------- comparisons
@dataclass
class Comparison:
    question: str
    results: dict[str, SimResult] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def static_vs_continuous(model: str = "llama-3.1-8b", hardware: str = "h100-sxm", request_rate: float = 8.0,
                         workload: str = "chat", **workload_overrides) -> Comparison:
    m, hw, wl = get_model(model), get_hardware(hardware), make_workload(workload, **workload_overrides)
    c = Comparison(f"static vs continuous batching: {m.name} on {hw.name}, {workload} at {request_rate} req/s")
    vllm = get_profile("vllm")
    nochunk = vllm.with_(name="vllm-nochunk", chunked_prefill=False, max_num_batched_tokens=m.max_context)
    for label, prof in (("static", get_profile("static")), ("continuous, no chunked prefill", nochunk),
                        ("continuous + chunked prefill", vllm)):
        c.results[label] = simulate(wl, m, hw, prof, request_rate=request_rate)
    # where chunking matters: long prompts arriving together while others stream
    bursts = make_workload("interference", **BURSTS)
    c.results["bursts: no chunked prefill"] = simulate(bursts, m, hw, nochunk)
    c.results["bursts: chunked prefill"] = simulate(bursts, m, hw, vllm)
    c.notes.append(f"bursts: {BURSTS['cohort']} streams of {BURSTS['input_len']} -> {BURSTS['output_len']} tokens, "
                   f"then {BURSTS['burst']} prompts of {BURSTS['burst_len']} tokens at once after "
                   f"{BURSTS['burst_delay']:g} s; whole-prompt prefill runs the burst in one step and every stream "
                   "waits for it (ITL p99), chunks of 8192 tokens keep the streams moving")
    return c


# the bursts of long prompts `sim batching` compares chunked and whole-prompt prefill on
BURSTS = dict(cohort=32, input_len=512, output_len=64, burst=8, burst_len=16000, burst_output_len=16,
              burst_delay=0.3)


def cache_aware_vs_fcfs(model: str = "llama-3.1-8b", hardware: str = "h100-sxm", kv_tokens: int = 20_000,
                        request_rate: float = 20.0) -> Comparison:
    """Radix-cache order on a RAG workload whose working set exceeds the KV budget, and the same with
    each prompt's prefix pieces shuffled (hit rate collapses whatever the order)."""
    m, hw = get_model(model), get_hardware(hardware)
    c = Comparison(f"cache-aware vs FCFS: {m.name} on {hw.name}, KV budget {kv_tokens} tokens, {request_rate} req/s")
    blocks = kv_tokens // 16
    for scrambled in (False, True):
        wl = make_workload("rag", scramble=scrambled)
        for policy in ("fcfs", "lpm", "dfs-weight"):
            prof = get_profile("sglang").with_(schedule_policy=policy)
            key = f"{'scrambled' if scrambled else 'rag'} / {policy}"
            c.results[key] = simulate(wl, m, hw, prof, request_rate=request_rate, num_kv_blocks=blocks)
        c.notes.append(f"{'scrambled' if scrambled else 'rag'}: achievable shared fraction "
                       f"{wl.shared_prefix_fraction:.1%}")
    return c


def offload_vs_recompute(model: str = "llama-3.1-8b", hardware: str = "h100-sxm", kv_tokens: int = 40_000,
                         host_gb: float = 64.0) -> Comparison:
    """Agent conversations whose histories outgrow device KV: evicted prefixes recomputed vs copied
    back from a host tier."""
    m, hw = get_model(model), get_hardware(hardware)
    c = Comparison(f"host-tier offload vs recompute: {m.name} on {hw.name}, device KV {kv_tokens} tokens")
    wl = make_workload("agent")
    prof = get_profile("sglang")
    c.results["recompute (no tier)"] = simulate(wl, m, hw, prof, num_kv_blocks=kv_tokens // 16, max_concurrency=40)
    c.results[f"host tier {host_gb:g} GB"] = simulate(wl, m, hw, prof, num_kv_blocks=kv_tokens // 16,
                                                      max_concurrency=40, host_tier_gb=host_gb)
    kvb = m.kv_bytes_per_token(prof.kv)
    rf_prefill = 2 * m.active_params / (hw.peak_flops(prof.weights) * hw.mfu)
    c.notes.append(f"per evicted prefix token: recompute ~{rf_prefill * 1e6:.1f} us of prefill vs "
                   f"~{kvb / (hw.host_link_gbps * 1e9) * 1e6:.1f} us to copy its {kvb / 1024:.0f} KiB back over "
                   f"the {hw.host_link_gbps:g} GB/s host link; saves to the tier overlap the step, loads do not. "
                   "The tier wins where prefill is dear (large models, long histories) and the link is fast")
    return c


@dataclass
class Pick:
    engine: str
    reasons: list[str]
    comparison: Comparison


def pick_engine(hardware: str, scale: int, workload: str, model: str = "llama-3.1-8b",
                slo_ttft_p99_ms: float = 2000.0, slo_itl_p50_ms: float = 50.0, utilization: float = 0.7,
                tp: int | None = None, **workload_overrides) -> Pick:
    """The stack to run ``workload`` (chat, code, rag, agent, batch) on ``scale`` devices of ``hardware``.

    Each profile is simulated twice on one replica (the smallest tensor-parallel group that holds the
    model): saturated, for its capacity and cost per million output tokens at ``utilization``; then
    at ``utilization`` of that capacity, for the latencies a user would see. Among the profiles meeting
    the SLOs, the cheapest wins (the cheapest overall where none does)."""
    m, hw = get_model(model), get_hardware(hardware)
    c = Comparison(f"pick an engine: {m.name} on {scale} x {hw.name}, {workload}; SLOs: TTFT p99 <= "
                   f"{slo_ttft_p99_ms:g} ms, ITL p50 <= {slo_itl_p50_ms:g} ms")
    why: dict[str, str] = {}
    for name in ("vllm", "sglang", "trtllm", "llamacpp", "static"):
        prof = get_profile(name)
        replica_tp = tp or _tp_needed(m, prof, hw, scale)
        if replica_tp is None or replica_tp > scale:
            c.notes.append(f"{name}: {m.name} does not fit on {scale} x {hw.key} at {prof.weights}")
            continue
        fp = footprint(m, prof, hw, replica_tp)
        if fp.kv_budget_gb <= 0:
            c.notes.append(f"{name}: {m.name} does not fit on {replica_tp} x {hw.key} at {prof.weights}")
            continue
        why[name] = (f"TP={replica_tp} ({scale // replica_tp} replica(s)): {prof.weights} weights take "
                     f"{fp.weights_gb:.0f} GB, leaving {fp.kv_budget_gb:.0f} GB of KV on {replica_tp} x {hw.key}"
                     + ("" if tp else " (the smallest power of two leaving 10% of memory for KV)"))
        try:
            wl_sat, rate = _at_rate(workload, None, **workload_overrides)
            sat = simulate(wl_sat, m, hw, prof, tp=replica_tp, request_rate=rate)
            wl_load, rate = _at_rate(workload, max(1e-3, utilization * sat.request_throughput), **workload_overrides)
            loaded = simulate(wl_load, m, hw, prof, tp=replica_tp, request_rate=rate)
        except (InvalidArgumentError, RuntimeError) as e:
            c.notes.append(f"{name}: {e}")
            continue
        # capacity (and so cost) from the saturated run, latencies from the loaded one
        loaded.output_tokens_per_s = sat.output_tokens_per_s
        c.results[name] = loaded
    if not c.results:
        raise InvalidArgumentError(f"{m.name} fits on {scale} x {hw.key} under no profile")

    def meets(r: SimResult) -> bool:
        return bool(r.ttft_ms and r.itl_ms and r.ttft_ms.p99 <= slo_ttft_p99_ms and r.itl_ms.p50 <= slo_itl_p50_ms)

    ok = {k: r for k, r in c.results.items() if meets(r)}
    pool = ok or c.results
    def cost(k: str) -> float:
        return pool[k].cost_per_million_output_tokens(utilization)

    best = min(pool, key=cost)
    r = c.results[best]
    reasons = [f"{best}: {r.output_tokens_per_s:.0f} output tok/s per replica of {r.devices} device(s), "
               f"${cost(best):.3f} per 1M output tokens at {utilization:.0%} utilization, TTFT p99 "
               f"{r.ttft_ms.p99 if r.ttft_ms else 0:.0f} ms, ITL p50 {r.itl_ms.p50 if r.itl_ms else 0:.1f} ms, "
               f"prefix hits {r.prefix_hit_rate:.0%}"]
    reasons.append(f"{best}: {why[best]}")
    if not ok:
        reasons.append(f"no profile met TTFT p99 <= {slo_ttft_p99_ms:g} ms and ITL p50 <= {slo_itl_p50_ms:g} ms: "
                       "picked the cheapest")
    for k, o in c.results.items():
        if k != best:
            misses = "" if k in ok else (f" (misses the SLOs: TTFT p99 {o.ttft_ms.p99 if o.ttft_ms else 0:.0f} ms, "
                                         f"ITL p50 {o.itl_ms.p50 if o.itl_ms else 0:.1f} ms)")
            reasons.append(f"{k}: {o.output_tokens_per_s:.0f} tok/s, "
                           f"${o.cost_per_million_output_tokens(utilization):.3f}/1M{misses}; {why[k]}")
    return Pick(best, reasons, c)


def _tp_needed(m: ModelSpec, prof: EngineProfile, hw: Hardware, scale: int) -> int | None:
    """The smallest power-of-two tensor-parallel degree whose devices hold the weights with room for KV."""
    tp = 1
    while tp <= scale:
        fp = footprint(m, prof, hw, tp)
        if fp.kv_budget_gb > 0.1 * hw.hbm_gb * tp:
            return tp
        tp *= 2
    return None
