"""The simulator against published GPU measurements: simulate each recorded point, fit the free
cost terms on half of them, score the other half.

Points live in ``kvserve/sim/data/validation.json`` (source URL, where in the source, workload,
settings, published value). Each is simulated with kvserve's own scheduler under the engine's
profile and cost terms, at most ``MAX_SIM_REQUESTS`` requests (an offline run of thousands of
fixed-length requests runs in waves: one wave's throughput is about the run's), a closed loop
at concurrency c measured in steady state (c warm-up requests, then 2c), a seeded bench_serving run
whole and as it drew it (after the runs of its series on the same server), Poisson arrivals for
40 seconds. The split is fixed:
of the points in use, in file order, even positions fit and odd positions are held back.
The fit is Gauss-Newton over each engine's ``fitted_fields`` minimizing the squared log error on
its fit points; ``kvserve sim validate --fit`` writes ``data/fitted_terms.json``.
"""

from __future__ import annotations

import functools
import json
import math
import random
import statistics
from dataclasses import dataclass
from importlib import resources

from kvserve.bench.datasets import Session, Turn, Workload
from kvserve.sim.engine_costs import EngineCosts, costs_for, fitted_fields, load_fitted
from kvserve.sim.hardware import get_hardware
from kvserve.sim.models import get_model
from kvserve.sim.profiles import get_profile
from kvserve.sim.simulate import Run, SimResult, simulate_runs

MAX_SIM_REQUESTS = 256
# a closed loop at concurrency c: c warm-up requests, then at least 2c measured ones (up to this many in all)
MAX_CLOSED_LOOP_REQUESTS = 768
GOAL_MEDIAN, GOAL_MAX = 0.15, 0.35
BENCH_SERVING_BASE_TOKENS = 257  # a stand-in ShareGPT conversation's length (any length shares the same way)


@functools.cache
def _data() -> dict:
    return json.loads(resources.files("kvserve.sim").joinpath("data", "validation.json").read_text())


def load_points() -> list[dict]:
    return _data()["points"]


def load_series() -> dict[str, list[dict]]:
    """Runs sent to one server one after another, by name: {"workload", "load"} each, in order."""
    return _data().get("series", {})


def split(points: list[dict]) -> tuple[list[dict], list[dict]]:
    """(fit, held back): the points in use, alternating in file order."""
    used = [p for p in points if p.get("use", True)]
    return used[0::2], used[1::2]


def bench_serving_lengths(w: dict) -> list[tuple[int, int]]:
    """(prompt, output) lengths of bench_serving's random dataset, drawn as it draws them: after
    ``np.random.seed(seed)``, every input length, then every output length, from numpy's legacy
    ``randint`` over [max(1, L x range_ratio), L] and [O x range_ratio, O]. The server then generates
    one token more than drawn: the published totals are the draws' sums plus one per request."""
    import numpy as np

    rs = np.random.RandomState(w["seed"])
    n, lo = w["num_prompts"], w.get("range_ratio", 0.0)
    ins = rs.randint(max(int(w["input_len"] * lo), 1), w["input_len"] + 1, size=n)
    outs = rs.randint(int(w["output_len"] * lo), w["output_len"] + 1, size=n)
    return [(int(i), int(o) + 1) for i, o in zip(ins, outs)]


def bench_serving_prompt(index: int, length: int) -> list[int]:
    """Prompt ``index`` of a bench_serving random run: the index-th conversation of its (seeded, so
    every run's same) shuffle of ShareGPT, repeated or cut to ``length`` tokens. Runs against one
    server thus share each index's prompt up to the shorter length, and its radix cache serves it."""
    rng = random.Random(f"bench_serving:{index}")
    base = [rng.randrange(100, 30000) for _ in range(BENCH_SERVING_BASE_TOKENS)]
    return (base * (length // len(base) + 1))[:length]


def _runs_for(p: dict) -> list[Run]:
    """The benchmark run(s) of a point's setting: a bench_serving run (a seeded workload) is its warm-up
    request (the first prompt, at most 32 tokens) and then the whole run, measured whole; others are
    one run, a closed loop measured in steady state (its first c requests only warm it up)."""
    wl, rate, conc = workload_for(p)
    if "seed" not in p["workload"]:
        return [Run(wl, rate, conc, warmup_requests=conc or 0)]
    first = wl.sessions[0].turns[0]
    warmup = Workload("bench_serving warm-up", [Session([Turn(first.prompt, max(1, min(first.max_tokens - 1, 32)))])])
    return [Run(warmup), Run(wl, rate, conc)]


def workload_for(p: dict) -> tuple[Workload, float, int | None]:
    """The point's workload (capped in size unless it is a seeded bench_serving run), its request rate
    and its concurrency cap."""
    w, load = p["workload"], p["load"]
    conc, rate = load.get("concurrency"), load.get("request_rate")
    if "seed" in w:  # bench_serving's own draws: every request of the run, as it sent them
        turns = [Turn(bench_serving_prompt(i, n_in), n_out) for i, (n_in, n_out) in enumerate(bench_serving_lengths(w))]
        return Workload(p.get("id", "point"), [Session([t]) for t in turns]), float(rate or math.inf), conc
    if conc:
        n = min(conc + max(2 * conc, 16), MAX_CLOSED_LOOP_REQUESTS)
    elif rate:
        n = min(w["num_prompts"], int(40 * rate))
    else:
        n = min(w["num_prompts"], MAX_SIM_REQUESTS)
    rng = random.Random(0)
    turns = []
    for _ in range(n):
        if w["kind"] == "fixed":
            i, o = w["input_len"], w["output_len"]
        elif w["kind"] == "random":  # bench_serving's random dataset: uniform in [max(1, L x ratio), L]
            lo = w.get("range_ratio", 0.0)
            i = rng.randint(max(1, int(w["input_len"] * lo)), w["input_len"])
            o = rng.randint(max(1, int(w["output_len"] * lo)), w["output_len"])
        else:  # ShareGPT-like: lognormal lengths with the published means (sigma 1)
            i = max(4, min(4000, int(rng.lognormvariate(math.log(w["input_mean"]) - 0.5, 1.0))))
            o = max(1, min(2000, int(rng.lognormvariate(math.log(w["output_mean"]) - 0.5, 1.0))))
        turns.append(Turn([rng.randrange(100, 30000) for _ in range(i)], o))
    return Workload(p.get("id", "point"), [Session([t]) for t in turns]), float(rate or math.inf), conc


def metric(r: SimResult, name: str, p: dict | None = None) -> float:
    # an offline ShareGPT run of thousands of requests is mostly steady state; a capped one would be
    # mostly its first fill and its drain tail (a few long answers alone): its steady rate stands in
    offline_trace = p is not None and p["workload"]["kind"] != "fixed" and not any(p["load"].values())
    steady = offline_trace or r.warmup_requests > 0
    if name == "output_tok_s":
        return r.steady_output_tokens_per_s if steady else r.output_tokens_per_s
    return {"ttft_mean_ms": lambda: r.ttft_ms.mean, "ttft_p50_ms": lambda: r.ttft_ms.p50,
            "itl_mean_ms": lambda: r.itl_ms.mean, "itl_p50_ms": lambda: r.itl_ms.p50,
            "tpot_p50_ms": lambda: r.tpot_ms.p50,
            "batch_latency_s": lambda: r.duration_s}[name]()  # type: ignore[union-attr]


# the fields that decide a simulation: points that differ only in metric (and value) share one run
SETTING_FIELDS = ("engine", "hardware", "model", "tp", "weights", "kv", "engine_flags")


@functools.lru_cache(maxsize=64)
def _simulate_setting(setting: str, costs: EngineCosts) -> tuple[SimResult, ...]:
    """Each of the setting's runs' results; its runs go to one server, one after another."""
    p = json.loads(setting)
    # engine_flags: how the measured version differed from the profile's (SGLang 0.3 had no overlap scheduler)
    prof = get_profile(p["engine"]).with_(weights=p["weights"], kv=p["kv"], spec_tokens=0, acceptance=0.0,
                                          costs_override=costs.with_(**(p.get("engine_flags") or {})))
    # a closed loop is measured in steady state: its first c requests, started all at once, only warm
    # it up (genai-perf / perf_analyzer measure in windows once the rate is stable); otherwise
    # fixed-length requests stay in lockstep waves whose prompts queue behind each other. A series'
    # runs went to one server in order: each finds the earlier ones' prompts in its prefix cache.
    runs: list[Run] = []
    ends = []
    for run in p["runs"]:
        runs += _runs_for(run)
        ends.append(len(runs) - 1)
    results = simulate_runs(runs, get_model(p["model"]), get_hardware(p["hardware"]), prof, tp=p["tp"])
    return tuple(results[i] for i in ends)


def simulate_point(p: dict, costs: EngineCosts | None = None) -> float:
    """The point's metric, simulated: a point of a series is run ``p["run"]`` of its series."""
    setting = {k: p.get(k) for k in SETTING_FIELDS}
    if "series" in p:
        setting["runs"], index = load_series()[p["series"]], p["run"]
    else:
        setting["runs"], index = [{"workload": p["workload"], "load": p["load"]}], 0
    results = _simulate_setting(json.dumps(setting, sort_keys=True), costs or costs_for(p["engine"]))
    return metric(results[index], p["metric"], p)


@dataclass
class Scored:
    point: dict
    simulated: float

    @property
    def error(self) -> float:
        return self.simulated / self.point["value"] - 1


def score(points: list[dict], fitted: dict | None = None) -> list[Scored]:
    fitted = load_fitted() if fitted is None else fitted
    return [Scored(p, simulate_point(p, costs_for(p["engine"], fitted))) for p in points]


def summary(scored: list[Scored]) -> dict[str, float]:
    errs = [abs(s.error) for s in scored]
    return {"points": len(errs), "median_abs_error": statistics.median(errs) if errs else 0.0,
            "max_abs_error": max(errs, default=0.0)}


def fit(points: list[dict], iterations: int = 2, log=print, damping: float = 0.02,
        start: dict[str, dict[str, float]] | None = None) -> dict[str, dict[str, float]]:
    """Per engine, Gauss-Newton on the log errors of its fit points over log(fitted_fields(engine)): each
    iteration simulates the points once as they are and once per term nudged by 20%, solves the
    linearized least squares (Levenberg-damped by ``damping`` x points, each step at most a factor
    of 3), and keeps the step, or half or a quarter of it, if it helps. ``start``: terms per engine
    to start from (else the catalog's)."""
    import numpy as np

    out: dict[str, dict[str, float]] = {}
    for engine in sorted({p["engine"] for p in points}):
        mine = [p for p in points if p["engine"] == engine]
        base = costs_for(engine, {engine: start[engine]} if start and engine in start else {})
        names = fitted_fields(engine)
        theta = {k: float(getattr(base, k)) for k in names}

        def residuals(th: dict[str, float]) -> np.ndarray:
            c = base.with_(**th)
            return np.array([math.log(simulate_point(p, c) / p["value"]) for p in mine])

        r = residuals(theta)
        for it in range(iterations):
            cols = []
            for k in names:
                cols.append((residuals(dict(theta, **{k: theta[k] * 1.2})) - r) / math.log(1.2))
            jac = np.stack(cols, axis=1)
            lam = damping * len(mine)  # keeps weakly determined terms near where they are
            step = np.linalg.solve(jac.T @ jac + lam * np.eye(len(names)), -jac.T @ r)
            step = np.clip(step, -math.log(3), math.log(3))
            for _ in range(3):  # the full step, else half of it, else a quarter
                trial = {k: theta[k] * math.exp(s) for k, s in zip(names, step)}
                r_trial = residuals(trial)
                log(f"{engine} iteration {it + 1}: rms log error {np.sqrt(np.mean(r ** 2)):.3f} -> "
                    f"{np.sqrt(np.mean(r_trial ** 2)):.3f} with {trial}")
                if np.mean(r_trial ** 2) < np.mean(r ** 2):
                    break
                step = step / 2
            else:
                break
            theta, r = trial, r_trial
        out[engine] = {k: float(f"{v:.6g}") for k, v in theta.items()}
    return out
