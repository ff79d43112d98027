#!/usr/bin/env python3
"""Draw the Grafana dashboard's panels with matplotlib, from a real Prometheus's query API.

No Grafana installs from the registries this project's machines reach (docs/observability.md), so
this reads deploy/grafana/kvserve-dashboard.json, runs each panel's PromQL through Prometheus's
/api/v1/query_range (``$instance`` filled per replica, as Grafana repeats the row, and
``$__rate_interval`` as Grafana computes it from the scrape interval) and draws one PNG grid.

    python scripts/render_dashboard.py --prometheus http://127.0.0.1:9090 --minutes 10 --out docs/img/dashboard.png
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvserve.bench import dashboard  # noqa: E402

COLUMNS = 4
# Grafana's unit -> (scale, axis label)
UNITS = {"s": (1e3, "ms"), "percentunit": (100.0, "%"), "bytes": (2.0 ** -20, "MiB"), "Bps": (2.0 ** -20, "MiB/s"),
         "reqps": (1.0, "req/s"), "short": (1.0, "")}


def sections(panels: list[dashboard.Panel], prometheus: str) -> list[tuple[str, dict[str, str], list[dashboard.Panel]]]:
    """(title, variables, panels) per drawn row: a repeated row once per value of its variable."""
    rows: dict[str, list[dashboard.Panel]] = {}
    for p in panels:
        rows.setdefault(p.row, []).append(p)
    out = []
    for title, members in rows.items():
        repeat = members[0].repeat
        if repeat is None:
            out.append((title, {}, members))
            continue
        values = dashboard.label_values(prometheus, repeat, "kvserve_num_requests_running")
        if not values:
            sys.exit(f"render_dashboard: Prometheus at {prometheus} has no kvserve_num_requests_running series")
        for v in values:
            out.append((title.replace(f"${repeat}", v), {repeat: v}, members))
    return out


def draw(ax, panel: dashboard.Panel, variables: dict[str, str], prometheus: str, start: float, end: float,
         step: float, rate_interval: str) -> None:
    scale, label = UNITS.get(panel.unit, (1.0, panel.unit))
    drawn = 0
    for target in panel.targets:
        expr = dashboard.fill(target.expr, variables, rate_interval)
        for s in dashboard.query_range(prometheus, expr, start, end, step, target.legend):
            ax.plot([t - start for t in s.times], [v * scale for v in s.values], linewidth=1.2, label=s.name)
            drawn += 1
    ax.set_title(panel.title, fontsize=9)
    ax.set_ylabel(label, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    ax.set_xlim(0, end - start)
    values = [v for line in ax.get_lines() for v in line.get_ydata() if math.isfinite(v)]
    if values and min(values) >= 0:  # counts and rates: from 0, so that a flat line reads as its value
        top = max(values) * 1.1 or 1.0
        ax.set_ylim(-0.03 * top, top)  # (a line at 0 stays above the axis)
    if drawn:
        ax.legend(fontsize=6, loc="upper left", framealpha=0.6)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prometheus", default="http://127.0.0.1:9090")
    ap.add_argument("--dashboard", type=Path, default=dashboard.DASHBOARD)
    ap.add_argument("--minutes", type=float, default=10.0, help="the range drawn: the N minutes up to --end")
    ap.add_argument("--end", type=float, default=None, help="unix seconds (default: now)")
    ap.add_argument("--scrape-interval", type=float, default=5.0, help="seconds, as in prometheus.yml")
    ap.add_argument("--out", type=Path, default=Path("docs/img/dashboard.png"))
    a = ap.parse_args()

    end = a.end if a.end is not None else time.time()
    start = end - 60 * a.minutes
    step = max(a.scrape_interval, (end - start) / 300)
    rate_interval = f"{int(max(4 * a.scrape_interval, step + a.scrape_interval))}s"  # Grafana's $__rate_interval
    board = dashboard.load(a.dashboard)
    drawn = sections(dashboard.panels(board), a.prometheus)
    heights = [math.ceil(len(members) / COLUMNS) for _, _, members in drawn]
    fig = plt.figure(figsize=(4.6 * COLUMNS, 2.9 * sum(heights) + 0.5 * len(drawn)), layout="constrained")
    fig.suptitle(f"{board['title']}: deploy/grafana/{a.dashboard.name} drawn by matplotlib from Prometheus "
                 f"(x: seconds since {time.strftime('%H:%M:%S UTC', time.gmtime(start))}; rate window {rate_interval})",
                 fontsize=11)
    for sub, (title, variables, members), h in zip(fig.subfigures(len(drawn), 1, height_ratios=heights), drawn, heights):
        sub.suptitle(title, fontsize=11, fontweight="bold", x=0.01, ha="left")
        axes = sub.subplots(h, COLUMNS, squeeze=False).ravel()
        for ax, panel in zip(axes, members):
            draw(ax, panel, variables, a.prometheus, start, end, step, rate_interval)
        for ax in axes[len(members):]:
            ax.axis("off")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=80)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
