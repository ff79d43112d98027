"""The table of scripts/bench_disagg.sh's runs: per mode, each run and the median (docs/scale-out.md).

Usage: python scripts/disagg_summary.py DIR
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main(out: Path) -> None:
    rows: dict[str, list[dict]] = {}
    for f in sorted(out.glob("*_[0-9]*.json")):
        mode = f.stem.rsplit("_", 1)[0]
        s = json.loads(f.read_text())["summary"]
        i = s["interference"] or {}
        load = (out / f"{f.stem}.uptime").read_text().split("load average:")[1].split(",")[0].strip()
        rows.setdefault(mode, []).append({
            "run": f.stem, "elapsed_s": s["elapsed_s"], "total_tok_s": (s["input_tokens"] + s["output_tokens"]) / s["elapsed_s"],
            "out_tok_s": s["output_tokens_per_s"], "before_ms": i.get("cohort_itl_p99_before_ms"),
            "during_ms": i.get("cohort_itl_p99_during_ms"), "ratio": i.get("ratio"), "load": load})
    print("| run | load (1 min) | elapsed s | total tok/s | out tok/s | cohort ITL p99 before burst (ms) "
          "| during burst (ms) | during / before |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode, runs in rows.items():
        for r in runs:
            print(f"| {r['run']} | {r['load']} | {r['elapsed_s']:.1f} | {r['total_tok_s']:.1f} | {r['out_tok_s']:.1f} | "
                  f"{r['before_ms']} | {r['during_ms']} | {r['ratio']}x |")
        med = {k: statistics.median(r[k] for r in runs) for k in ("elapsed_s", "total_tok_s", "out_tok_s",
                                                                   "before_ms", "during_ms", "ratio")}
        print(f"| **{mode} (median)** | | {med['elapsed_s']:.1f} | {med['total_tok_s']:.1f} | {med['out_tok_s']:.1f} | "
              f"{med['before_ms']:.1f} | {med['during_ms']:.1f} | {med['ratio']:.2f}x |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
