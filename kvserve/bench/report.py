"""How ``kvserve bench`` results are shown: the summary table, JSON-lines records, PNG plots
and the side-by-side markdown of ``bench compare``."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.bench.serve import RequestRecord, Summary
    from kvserve.bench.stats import Dist

_DISTS = [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E latency", "e2e_ms")]


def _fmt(v: object) -> str:
    return "-" if v is None else str(v)


def format_summary(s: Summary) -> str:
    """A fixed-width table for the terminal."""
    rows: list[tuple[str, str]] = [
        ("workload", s.description), ("server", f"{s.base_url} ({s.model})"),
        ("requests completed / sent", f"{s.completed} / {s.num_requests}"),
        ("errors", str(s.errors)), ("elapsed (s)", str(s.elapsed_s)),
        ("request throughput (req/s)", str(s.request_throughput)),
        ("input tokens (total, /s)", f"{s.input_tokens}, {s.input_tokens_per_s}"),
        ("output tokens (total, /s)", f"{s.output_tokens}, {s.output_tokens_per_s}"),
    ]
    if s.first_error:
        rows.append(("first error", s.first_error))
    if s.goodput is not None:
        slos = ", ".join(f"{name}<={_fmt(v)} ms" for name, v in (("TTFT", s.slo_ttft_ms), ("ITL", s.slo_itl_ms),
                                                                  ("TPOT", s.slo_tpot_ms)) if v is not None)
        rows.append((f"goodput (req/s; {slos})",
                     f"{s.goodput} ({s.good_requests} requests)"))
    if s.shared_prefix_fraction is not None:
        rows.append(("achievable shared prefix (of prompt tokens)", f"{s.shared_prefix_fraction:.1%}"))
    if s.prefix_hit_rate is not None:
        rows.append(("prefix cache hits (of prompt tokens, server's usage)", f"{s.prefix_hit_rate:.1%}"))
    width = max(len(k) for k, _ in rows)
    lines = ["=" * (width + 30), *(f"{k:<{width}}  {v}" for k, v in rows), "-" * (width + 30),
             f"{'(ms)':<{width}}  {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}"]
    for label, attr in _DISTS:
        d: Dist | None = getattr(s, attr)
        cells = [d.mean, d.p50, d.p90, d.p99] if d else [None] * 4
        lines.append(f"{label:<{width}}  " + " ".join(f"{_fmt(c):>9}" for c in cells))
    if s.interference:
        i = s.interference
        lines += ["-" * (width + 30),
                  f"{'cohort ITL p99 before burst (ms)':<{width}}  {_fmt(i.cohort_itl_p99_before_ms)}",
                  f"{'cohort ITL p99 during burst (ms)':<{width}}  {_fmt(i.cohort_itl_p99_during_ms)}",
                  f"{'during / before':<{width}}  {_fmt(i.ratio)}"]
    lines.append("=" * (width + 30))
    return "\n".join(lines)


def write_records(path: str, records: list[RequestRecord]) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")


def check_plot_available(path: str | None) -> None:
    """Fail before a long run, not after it, when ``--plot`` cannot be honoured."""
    import importlib.util

    from kvserve.errors import InvalidArgumentError

    if path and importlib.util.find_spec("matplotlib") is None:
        raise InvalidArgumentError("--plot needs matplotlib: pip install matplotlib")


def plot(runs: dict[str, list[RequestRecord]], path: str) -> None:
    """TTFT and ITL distributions (empirical CDFs), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, records in runs.items():
        ok = [r for r in records if r.ok]
        for ax, values in ((axes[0], [r.ttft * 1e3 for r in ok if r.ttft is not None]),
                           (axes[1], [x * 1e3 for r in ok for x in r.itls])):
            if values:
                xs = sorted(values)
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    for ax, title in zip(axes, ("TTFT", "ITL")):
        ax.set_title(f"{title} distribution")
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of " + ("requests" if title == "TTFT" else "gaps"))
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def compare_markdown(summaries: dict[str, Summary]) -> str:
    """One column per server, one row per figure."""
    names = list(summaries)
    rows: list[tuple[str, list[object]]] = [
        ("completed", [s.completed for s in summaries.values()]),
        ("errors", [s.errors for s in summaries.values()]),
        ("request throughput (req/s)", [s.request_throughput for s in summaries.values()]),
        ("output tokens/s", [s.output_tokens_per_s for s in summaries.values()]),
        ("input tokens/s", [s.input_tokens_per_s for s in summaries.values()]),
        ("goodput (req/s)", [s.goodput for s in summaries.values()]),
    ]
    if any(s.prefix_hit_rate is not None for s in summaries.values()):
        rows.append(("prefix cache hits (of prompt tokens)", [None if s.prefix_hit_rate is None else
                                                              f"{s.prefix_hit_rate:.1%}" for s in summaries.values()]))
    if any(s.interference and s.interference.ratio for s in summaries.values()):
        rows.append(("cohort ITL p99 during / before burst", [f"{s.interference.ratio:.2f}x" if s.interference and
                                                              s.interference.ratio else None for s in summaries.values()]))
    for label, attr in _DISTS:
        for q in ("p50", "p99"):
            rows.append((f"{label} {q} (ms)", [getattr(getattr(s, attr), q, None) for s in summaries.values()]))
    first = next(iter(summaries.values()))
    out = [f"Workload: {first.description}", "", "| | " + " | ".join(names) + " |",
           "|---|" + "---|" * len(names)]
    out += [f"| {label} | " + " | ".join(_fmt(v) for v in vals) + " |" for label, vals in rows]
    return "\n".join(out) + "\n"
