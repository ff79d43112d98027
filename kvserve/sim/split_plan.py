"""``kvserve plan --split``: colocated replicas or a prefill/decode split, and how many of each, for a
GPU, a model and a workload.

The devices are cut into replicas of ``tp`` devices (the fewest that hold the model with room for
KV), and every layout is simulated (``kvserve.sim.cluster``): all replicas colocated, or P prefill
and N - P decode replicas for each P. A layout's figure is its goodput, DistServe's measure: the
highest request rate (the workload's own arrival pattern, rescaled) at which at least 90% of
requests meet both the TTFT and the TPOT SLO, found by doubling then bisection. The best layout is the answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.errors import InvalidArgumentError
from kvserve.sim.cluster import ClusterRun, KVLink, Layout, simulate_cluster
from kvserve.sim.hardware import get_hardware
from kvserve.sim.models import get_model
from kvserve.sim.planner import _at_rate, _tp_needed
from kvserve.sim.profiles import get_profile

ATTAINMENT = 0.9  # the share of requests that must meet both SLOs
SEARCH_STEPS = 6  # bisections of the rate: within 1/64 of the bracket found by doubling
MAX_DOUBLINGS = 6


@dataclass
class LayoutGoodput:
    layout: Layout
    goodput: float  # requests/s meeting the attainment
    run: ClusterRun | None  # the run at that rate (None: not even the lowest rate tried met it)


@dataclass
class SplitPlan:
    question: str
    rows: list[LayoutGoodput]
    best: LayoutGoodput
    notes: list[str] = field(default_factory=list)

    @property
    def colocated(self) -> LayoutGoodput:
        return self.rows[0]


def layout_goodput(layout: Layout, start: float, slo_ttft_s: float, slo_tpot_s: float,
                   run_at: Callable[[float], ClusterRun], steps: int = SEARCH_STEPS) -> LayoutGoodput:
    """The highest rate whose attainment is at least ``ATTAINMENT`` (``run_at(rate)`` simulates the layout
    at a rate): doubled from ``start`` until it fails (or halved until it holds), then bisected."""
    def meets(rate: float) -> tuple[bool, ClusterRun]:
        run = run_at(rate)
        return run.attainment(slo_ttft_s, slo_tpot_s) >= ATTAINMENT, run

    ok, run = meets(start)
    lo, hi, best = (start, start * 2, run) if ok else (0.0, start, None)
    for _ in range(MAX_DOUBLINGS):
        if not ok:
            break
        ok, run = meets(hi)
        if ok:
            lo, hi, best = hi, hi * 2, run
    for _ in range(steps):
        mid = (lo + hi) / 2
        ok, run = meets(mid)
        lo, hi, best = (mid, hi, run) if ok else (lo, mid, best)
    return LayoutGoodput(layout, lo, best)


def plan_split(hardware: str = "h100-sxm", gpus: int = 8, model: str = "llama-3.1-70b", workload: str = "chat",
               profile: str = "vllm", weights: str | None = "fp8", kv: str | None = "fp8", tp: int | None = None,
               slo_ttft_ms: float = 1000.0, slo_tpot_ms: float = 50.0, kv_link: str | None = None,
               **workload_overrides) -> SplitPlan:
    m, hw = get_model(model), get_hardware(hardware)
    prof = get_profile(profile)
    prof = prof.with_(**{k: v for k, v in (("weights", weights), ("kv", kv)) if v})
    tp = tp or _tp_needed(m, prof, hw, gpus)
    if tp is None or tp > gpus:
        raise InvalidArgumentError(f"{m.name} at {prof.weights} does not fit on {gpus} x {hw.key}")
    n = gpus // tp
    link = KVLink.of(hw, kv_link)
    hops = " + ".join(f"{g:g} GB/s, {lat * 1e6:g} us" for g, lat in link.hops)
    plan_q = (f"split or not: {m.name} ({prof.weights} weights, {prof.kv} KV, {profile}) on {gpus} x {hw.name} "
              f"as {n} replica(s) of TP={tp}, {workload}; SLOs: TTFT <= {slo_ttft_ms:g} ms and TPOT <= "
              f"{slo_tpot_ms:g} ms for {ATTAINMENT:.0%} of requests; KV link per device: {hops}")

    def runner(layout: Layout) -> Callable[[float], ClusterRun]:
        def run_at(rate: float) -> ClusterRun:
            wl, r = _at_rate(workload, rate, **workload_overrides)
            return simulate_cluster(wl, m, hw, prof, layout, link=link, request_rate=r)
        return run_at

    colocated = Layout(0, n, tp)
    wl_sat, rate = _at_rate(workload, None, **workload_overrides)
    capacity = simulate_cluster(wl_sat, m, hw, prof, colocated, link=link, request_rate=rate).result
    start = capacity.request_throughput  # where the search starts: the colocated replicas' saturated rate
    layouts = [colocated] + [Layout(p, n - p, tp) for p in range(1, n)]
    rows = [layout_goodput(lay, start, slo_ttft_ms / 1e3, slo_tpot_ms / 1e3, runner(lay)) for lay in layouts]
    best = max(rows, key=lambda r: (r.goodput, r.layout is colocated))  # a tie: no split (fewer moving parts)
    plan = SplitPlan(plan_q, rows, best)
    plan.notes.append(f"colocated capacity (every request at once): {capacity.request_throughput:.2f} req/s, "
                      f"{capacity.output_tokens_per_s:.0f} output tok/s; each layout's rate searched from there")
    if n < 2:
        plan.notes.append(f"one replica of TP={tp} fills the {gpus} devices: a split needs two (more devices or a "
                          "smaller --tp)")
    return plan


def report(plan: SplitPlan) -> list[str]:
    """The plan as Markdown lines: a row per layout, then the answer."""
    def d(run: ClusterRun | None, q: str, p: str) -> str:
        dist = getattr(run.result, q) if run is not None else None
        return "-" if dist is None else f"{getattr(dist, p):.0f}"

    out = [plan.question, "", "| layout | goodput (req/s) | per device | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
           "| ITL p99 (ms) | out tok/s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in plan.rows:
        tok = f"{r.run.result.output_tokens_per_s:.0f}" if r.run is not None else "-"
        out.append(f"| {r.layout.name} | {r.goodput:.2f} | {r.goodput / r.layout.devices:.3f} | "
                   f"{d(r.run, 'ttft_ms', 'p50')} / {d(r.run, 'ttft_ms', 'p99')} | {d(r.run, 'tpot_ms', 'p50')} / "
                   f"{d(r.run, 'tpot_ms', 'p99')} | {d(r.run, 'itl_ms', 'p99')} | {tok} |")
    out += [f"- {n}" for n in plan.notes]
    b, c = plan.best, plan.colocated
    if b is c:
        out.append(f"\nanswer: colocated ({c.layout.decode} replicas): no split has more goodput "
                   f"({c.goodput:.2f} req/s)")
    else:
        gain = f"{b.goodput / c.goodput:.2f}x" if c.goodput else "where colocated meets the SLOs at no rate tried"
        out.append(f"\nanswer: split, {b.layout.prefill} prefill + {b.layout.decode} decode replicas: goodput "
                   f"{b.goodput:.2f} req/s against {c.goodput:.2f} colocated ({gain})")
    return out
