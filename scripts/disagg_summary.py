"""The table of scripts/bench_disagg.sh's runs: per mode, each run and the median (docs/scale-out.md).

"before" and "during" are the cohort's ITL p99 before the burst is sent and while it runs. Where the
directory holds the mode's ``-alone`` runs (the cohort without the burst), "alone" is their ITL p99 over
the same window (the median burst window of the mode's runs): the same stream positions, so the same
context lengths, which the target compares against ("during / alone").

Usage: python scripts/disagg_summary.py DIR
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from kvserve.bench.serve import RequestRecord, cohort_itl_p99_ms


def _records(data: dict) -> list[RequestRecord]:
    return [RequestRecord(**r) for r in data["requests"]]


def main(out: Path) -> None:
    rows: dict[str, list[dict]] = {}
    records: dict[str, list[list[RequestRecord]]] = {}
    for f in sorted(out.glob("*_[0-9]*.json")):
        mode = f.stem.rsplit("_", 1)[0]
        data = json.loads(f.read_text())
        s = data["summary"]
        i = s["interference"] or {}
        records.setdefault(mode, []).append(_records(data))
        load = (out / f"{f.stem}.uptime").read_text().split("load average:")[1].split(",")[0].strip()
        rows.setdefault(mode, []).append({
            "run": f.stem, "elapsed_s": s["elapsed_s"], "total_tok_s": (s["input_tokens"] + s["output_tokens"]) / s["elapsed_s"],
            "out_tok_s": s["output_tokens_per_s"], "before_ms": i.get("cohort_itl_p99_before_ms"),
            "during_ms": i.get("cohort_itl_p99_during_ms"), "ratio": i.get("ratio"), "load": load,
            "window": (i.get("burst_start_s"), i.get("burst_end_s"))})
    print("| run | load (1 min) | elapsed s | total tok/s | out tok/s | cohort ITL p99 before burst (ms) "
          "| during burst (ms) | during / before | cohort alone, same window (ms) | during / alone |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, runs in rows.items():
        if mode.endswith("-alone"):
            continue
        window = tuple(statistics.median(r["window"][k] for r in runs) for k in (0, 1))
        alone = [cohort_itl_p99_ms(recs, *window) for recs in records.get(f"{mode}-alone", [])]
        alone_ms = statistics.median(alone) if alone and None not in alone else None
        for r in runs:
            vs = f"{r['during_ms'] / alone_ms:.2f}x" if alone_ms else "-"
            print(f"| {r['run']} | {r['load']} | {r['elapsed_s']:.1f} | {r['total_tok_s']:.1f} | {r['out_tok_s']:.1f} | "
                  f"{r['before_ms']} | {r['during_ms']} | {r['ratio']}x | | {vs} |")
        for run, ms in zip((r["run"] for r in rows.get(f"{mode}-alone", [])), alone):
            print(f"| {run} (no burst) | | | | | | | | {ms} | |")
        med = {k: statistics.median(r[k] for r in runs) for k in ("elapsed_s", "total_tok_s", "out_tok_s",
                                                                   "before_ms", "during_ms", "ratio")}
        alone_cell = f"{alone_ms:.1f}" if alone_ms else "-"
        vs = f"**{med['during_ms'] / alone_ms:.2f}x**" if alone_ms else "-"
        print(f"| **{mode} (median)** | | {med['elapsed_s']:.1f} | {med['total_tok_s']:.1f} | {med['out_tok_s']:.1f} | "
              f"{med['before_ms']:.1f} | {med['during_ms']:.1f} | {med['ratio']:.2f}x | {alone_cell} | {vs} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
