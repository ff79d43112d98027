"""Calibrate the simulator's "cpu" entry on this machine, then check it against the real engine.

1. Run the real engine (embedded model, this machine's dtype) on closed-loop random workloads at
   several concurrencies, recording every step's batch shape and measured time, and each
   request's TTFT and inter-token latencies.
2. Fit the entry's efficiency factors by least squares: step seconds ≈ overhead + per-sequence
   cost + linear FLOPs / (peak · mfu) + attention FLOPs / (peak · attn_mfu) + bytes / (bandwidth · mbu)
   (a CPU does compute and memory traffic one after the other, so the terms add).
3. Simulate the same workloads with the fitted entry and the ``kvserve`` profile, and print
   simulated against measured throughput, TTFT p50 and ITL p50.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, replace
from pathlib import Path

from kvserve import progress
from kvserve.bench.datasets import Session, Turn, Workload
from kvserve.bench.stats import median
from kvserve.sim.cost_model import ChunkShape, Roofline
from kvserve.sim.hardware import Hardware, get_hardware
from kvserve.sim.models import ModelSpec, get_model
from kvserve.sim.profiles import get_profile
from kvserve.sim.simulate import simulate


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--requests-per-level", type=int, default=None, help="default: 2 x concurrency, at least 4")
    p.add_argument("--output", default="cpu_calibration.json", help="where to write the fitted entry and the check")
    p.add_argument("--steps-file", default=None, help="also save the measured steps here (JSON) for later refits")


def workload(concurrency: int, n: int, input_len: int, output_len: int, seed: int = 0) -> Workload:
    rng = random.Random(seed + concurrency)
    sessions = [Session([Turn([rng.randrange(100, 40000) for _ in range(input_len)], output_len)]) for _ in range(n)]
    return Workload(f"random-c{concurrency}", sessions, description=f"random {input_len}->{output_len}")


def measure(wl: Workload, concurrency: int, llm) -> tuple[dict, list[tuple[list[ChunkShape], int, float]]]:
    """Closed loop on the real engine: ``concurrency`` requests in flight. Returns figures and steps."""
    import time

    from kvserve.engine.request import SamplingParams

    eng = llm.engine
    steps: list[tuple[list[ChunkShape], int, float]] = []
    execute = eng.runner.execute

    def timed(batch):
        t0 = time.perf_counter()
        out = execute(batch)
        shapes = [ChunkShape(c.start, c.num_tokens, c.sample) for c in batch.chunks]
        steps.append((shapes, len(batch.chunks), time.perf_counter() - t0))
        return out

    eng.runner.execute = timed
    pending = list(enumerate(wl.sessions))
    progress.expect(len(pending))
    sent: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    t_start = time.monotonic()
    try:
        while pending or eng.has_unfinished():
            while pending and eng.scheduler.num_running + eng.scheduler.num_waiting < concurrency:
                i, s = pending.pop(0)
                rid = f"cal{concurrency}-{i}"
                eng.add_request(rid, s.turns[0].prompt, SamplingParams(max_tokens=s.turns[0].max_tokens,
                                                                       ignore_eos=True, temperature=0.0))
                sent[rid] = time.monotonic()
                times[rid] = []
            for req in eng.step():
                times[req.request_id].append(time.monotonic())
                if req.is_finished:
                    eng.scheduler.requests.pop(req.request_id, None)
                    progress.advance()
    finally:
        eng.runner.execute = execute
    elapsed = time.monotonic() - t_start
    n_out = sum(len(t) for t in times.values())
    ttft = [times[r][0] - sent[r] for r in times]
    itl = [b - a for t in times.values() for a, b in zip(t, t[1:])]
    return {"output_tokens_per_s": n_out / elapsed, "ttft_p50_ms": median(ttft) * 1e3,
            "itl_p50_ms": median(itl) * 1e3}, steps


def fit(hw: Hardware, model: ModelSpec, weights: str, steps: list[tuple[list[ChunkShape], int, float]]) -> Hardware:
    """Least-squares fit of overhead, per-sequence cost, mfu, attention mfu and mbu to measured steps."""
    import numpy as np

    rf = Roofline(model, hw, weights, weights)
    rows, y = [], []
    for shapes, nseq, seconds in steps:
        c = rf.step(shapes)
        rows.append([1.0, nseq, c.linear_flops, c.attention_flops, c.weight_bytes + c.kv_bytes])
        y.append(seconds)
    # relative error: weigh each step by 1 / its time, so a 60 ms decode counts as much as a 5 s prefill
    # (steps at low concurrency are many and short; absolute errors would fit the long ones only)
    x, t = np.array(rows), np.array(y)
    x, t = x / t[:, None], np.ones_like(t)
    scale = x.max(axis=0)
    scale[scale == 0] = 1.0
    active = list(range(x.shape[1]))
    while True:  # non-negative least squares by dropping the terms that come out negative
        coef, *_ = np.linalg.lstsq(x[:, active] / scale[active], t, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active = [a for a, c in zip(active, coef) if c >= 0]
    full = np.zeros(x.shape[1])
    full[active] = np.maximum(coef, 0) / scale[active]
    c0, c_seq, c_lin, c_att, c_mem = full
    peak = hw.peak_flops(rf.compute_precision)
    big = 1e3  # a term the fit dropped costs (next to) nothing: a very high efficiency
    return replace(hw, overhead_s=float(c0), per_seq_s=float(c_seq), overlap=False,
                   mfu=float(1 / (c_lin * peak)) if c_lin > 0 else big,
                   attn_mfu=float(1 / (c_att * peak)) if c_att > 0 else big,
                   mbu=float(1 / (c_mem * hw.hbm_tbps * 1e12)) if c_mem > 0 else big)


def run(a: argparse.Namespace) -> dict:
    from kvserve.llm import LLM

    llm = LLM(prefill_step_factor=0)  # the fit wants the steps the scheduler makes without the time cap
    weights = "fp32" if str(llm.engine.runner.dtype) == "torch.float32" else "bf16"
    model, hw = get_model("smollm2-135m"), get_hardware("cpu")
    levels = {}
    all_steps = []
    for c in a.concurrency:
        n = a.requests_per_level or max(4, 2 * c)
        wl = workload(c, n, a.input_len, a.output_len)
        measured, steps = measure(wl, c, llm)
        levels[c] = (wl, measured)
        all_steps += steps
        print(f"measured c={c}: {measured['output_tokens_per_s']:.1f} tok/s, TTFT p50 {measured['ttft_p50_ms']:.0f} ms, "
              f"ITL p50 {measured['itl_p50_ms']:.1f} ms ({len(steps)} steps)")
    if a.steps_file:
        Path(a.steps_file).write_text(json.dumps([[[asdict(c) for c in sh], n, sec] for sh, n, sec in all_steps]))
    fitted = fit(hw, model, weights, all_steps)
    profile = get_profile("kvserve").with_(weights=weights, kv=weights, prefill_step_factor=0)
    rows = []
    print("| concurrency | tok/s measured | simulated | err | TTFT p50 measured (ms) | simulated | err "
          "| ITL p50 measured (ms) | simulated | err |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c, (wl, m) in levels.items():
        r = simulate(wl, model, fitted, profile, max_concurrency=c, num_kv_blocks=llm.engine.runner.num_kv_blocks,
                     max_model_len=llm.engine.max_model_len)
        s = {"output_tokens_per_s": r.output_tokens_per_s, "ttft_p50_ms": r.ttft_ms.p50 if r.ttft_ms else 0.0,
             "itl_p50_ms": r.itl_ms.p50 if r.itl_ms else 0.0}
        err = {k: (s[k] - m[k]) / m[k] for k in m}
        rows.append({"concurrency": c, "measured": m, "simulated": s, "relative_error": err})
        print(f"| {c} | {m['output_tokens_per_s']:.1f} | {s['output_tokens_per_s']:.1f} | {err['output_tokens_per_s']:+.0%} "
              f"| {m['ttft_p50_ms']:.0f} | {s['ttft_p50_ms']:.0f} | {err['ttft_p50_ms']:+.0%} "
              f"| {m['itl_p50_ms']:.1f} | {s['itl_p50_ms']:.1f} | {err['itl_p50_ms']:+.0%} |")
    entry = {k: v for k, v in asdict(fitted).items() if k not in ("key", "extra")}
    result = {"cpu": entry, "check": rows, "steps_fitted": len(all_steps)}
    Path(a.output).write_text(json.dumps(result, indent=1))
    print(f"fitted entry and check written to {a.output} (use it with --hardware-file after moving 'cpu' "
          f"into a catalog)")
    return result
