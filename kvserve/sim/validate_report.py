"""``kvserve sim validate``: fit (optionally), score every point, print the validation table, write
the per-point JSON and the simulated-vs-published throughput plot."""

from __future__ import annotations

import datetime
import json
import statistics
from importlib import resources
from pathlib import Path

from kvserve.sim import validate
from kvserve.sim.engine_costs import load_fitted

UNITS = {"output_tok_s": "out tok/s", "ttft_mean_ms": "TTFT mean ms", "ttft_p50_ms": "TTFT p50 ms",
         "itl_mean_ms": "ITL mean ms", "itl_p50_ms": "ITL p50 ms", "tpot_p50_ms": "TPOT p50 ms",
         "batch_latency_s": "batch s"}


def setting(p: dict) -> str:
    w, load = p["workload"], p["load"]
    lens = (f"{w['input_len']}/{w['output_len']}" if w["kind"] == "fixed"
            else f"random <={w['input_len']}/<={w['output_len']}" if w["kind"] == "random"
            else f"ShareGPT ~{w['input_mean']}/{w['output_mean']}")
    at = (f"c={load['concurrency']}" if load.get("concurrency") else
          f"{load['request_rate']} req/s" if load.get("request_rate") else "offline")
    return f"{p['model']} {p['weights']} TP{p['tp']} {p['hardware']}, {lens}, {at}"


def table(rows: list[dict]) -> str:
    out = ["| half | engine | source | setting | metric | published | simulated | error |",
           "|---|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        p = r["point"]
        host = p["source"].split("/")[2]
        err = "-" if r["error"] is None else f"{r['error']:+.0%}"
        sim = "-" if r["simulated"] is None else f"{r['simulated']:,.1f}"
        out.append(f"| {r['half']} | {p['engine']} | [{host}]({p['source']}) | {setting(p)} | {UNITS[p['metric']]} "
                   f"| {p['value']:,} | {sim} | {err} |")
    return "\n".join(out)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    thr = []
    for r in rows:
        p = r["point"]
        if r["simulated"] is None:
            continue
        if p["metric"] == "output_tok_s":
            thr.append(r)
        elif p["metric"] == "batch_latency_s":  # a static batch of B: drawn as B x output tokens / its seconds
            tokens = p["workload"]["num_prompts"] * p["workload"]["output_len"]
            batch = dict(p, value=tokens / p["value"], load={"concurrency": p["workload"]["num_prompts"]})
            thr.append(dict(r, point=batch, simulated=tokens / r["simulated"]))
    engines = sorted({r["point"]["engine"] for r in thr})
    fig, axes = plt.subplots(1, len(engines), figsize=(5 * len(engines), 4.2), squeeze=False)
    for ax, eng in zip(axes[0], engines):
        mine = [r for r in thr if r["point"]["engine"] == eng]
        groups: dict[str, list[dict]] = {}
        for r in mine:
            p = r["point"]
            key = f"{p['model'].removeprefix('llama-3.1-')} TP{p['tp']} {p['hardware']}"
            if p["load"].get("concurrency"):  # a sweep: one curve per workload
                w = p["workload"]
                key += f", {w['input_len']}/{w['output_len']}" if "input_len" in w else ", ShareGPT"
            groups.setdefault(key, []).append(r)
        for gi, (key, rs) in enumerate(sorted(groups.items())):
            rs = sorted(rs, key=lambda r: r["point"]["load"].get("concurrency") or 512)
            xs = [r["point"]["load"].get("concurrency") or 512 for r in rs]
            color = f"C{gi % 10}"
            line = "-" if len(set(xs)) > 1 else "none"
            ax.plot(xs, [r["point"]["value"] for r in rs], marker="o", linestyle=line, color=color,
                    label=f"{key} published")
            ax.plot(xs, [r["simulated"] for r in rs], marker="x", linestyle="--" if line == "-" else "none",
                    color=color, label=f"{key} simulated")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("concurrency or batch size (offline runs drawn at 512)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(eng)
        ax.legend(fontsize=6)
    fig.suptitle("kvserve sim validate: simulated (x, dashed) vs published (o, solid) output throughput; "
                 "sweeps over concurrency drawn as curves", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(fit: bool = False, output: str | None = None, plot_path: str | None = None) -> dict:
    points = validate.load_points()
    fit_pts, held = validate.split(points)
    fitted = load_fitted()
    if fit:
        fitted = validate.fit(fit_pts)
        doc = {"_about": "Free cost terms fitted by `kvserve sim validate --fit` on the fit half of "
               "kvserve/sim/data/validation.json (kvserve/sim/validate.py)",
               "date": datetime.date.today().isoformat(), "engines": fitted}
        target = Path(str(resources.files("kvserve.sim").joinpath("data", "fitted_terms.json")))
        target.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"fitted terms written to {target}")
    halves = {id(p): "fit" for p in fit_pts} | {id(p): "held back" for p in held}
    rows = []
    for p in points:
        if p.get("use", True):
            s = validate.score([p], fitted)[0]
            rows.append({"half": halves[id(p)], "point": p, "simulated": s.simulated, "error": s.error})
        else:
            rows.append({"half": "not used", "point": p, "simulated": None, "error": None})
    print(table(rows))
    result = {}
    for half in ("fit", "held back"):
        errs = sorted(abs(r["error"]) for r in rows if r["half"] == half)
        result[half] = {"points": len(errs), "median_abs_error": statistics.median(errs) if errs else 0.0,
                        "max_abs_error": max(errs, default=0.0)}
        print(f"{half}: {len(errs)} points, median |error| {result[half]['median_abs_error']:.1%}, "
              f"max {result[half]['max_abs_error']:.1%}")
    if output:
        Path(output).write_text(json.dumps({"summary": result, "fitted": fitted, "rows": [
            {"id": r["point"]["id"], "half": r["half"], "published": r["point"]["value"], "simulated": r["simulated"],
             "error": r["error"]} for r in rows]}, indent=1))
    if plot_path:
        plot(rows, plot_path)
    return result
