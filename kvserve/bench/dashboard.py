"""The Grafana dashboard's panels (deploy/grafana/kvserve-dashboard.json) run against a Prometheus.

Reads the dashboard JSON into ``Panel``s, fills in the Grafana variables its PromQL uses
(``$instance``, ``$__rate_interval``) and asks Prometheus's HTTP API (``/api/v1/query_range``)
for each target's series: what the tests check returns data and what scripts/render_dashboard.py
draws when no Grafana is at hand.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import httpx

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvserve-dashboard.json"


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str  # Grafana's legendFormat: "{{label}}" placeholders


@dataclass(frozen=True)
class Panel:
    row: str  # the title of the row it sits in ("" above the first row)
    repeat: str | None  # the variable its row repeats over, if any
    title: str
    unit: str
    targets: tuple[Target, ...]


@dataclass(frozen=True)
class Series:
    name: str  # the legend, placeholders filled
    times: list[float]  # unix seconds
    values: list[float]  # NaN where Prometheus answered NaN


def load(path: Path = DASHBOARD) -> dict:
    return json.loads(Path(path).read_text())


def panels(dashboard: dict) -> list[Panel]:
    """The dashboard's graph panels in order, each with its row (Grafana's layout: a row owns the
    panels after it, up to the next row)."""
    out, row, repeat = [], "", None
    for p in dashboard["panels"]:
        if p["type"] == "row":
            row, repeat = p["title"], p.get("repeat")
            continue
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        targets = tuple(Target(t["expr"], t.get("legendFormat", "")) for t in p.get("targets", ()))
        out.append(Panel(row, repeat, p["title"], unit, targets))
    return out


def fill(expr: str, variables: dict[str, str], rate_interval: str) -> str:
    """``expr`` with Grafana's variables replaced: ``$name`` / ``${name}`` by ``variables[name]``
    (a regex for ``=~`` matchers) and ``$__rate_interval`` by ``rate_interval``."""
    expr = expr.replace("$__rate_interval", rate_interval)

    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in variables:
            raise KeyError(f"the dashboard uses ${name}, which has no value")
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


def legend(fmt: str, labels: dict[str, str]) -> str:
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)
    return text or json.dumps(labels, sort_keys=True)


def query_range(prometheus: str, expr: str, start: float, end: float, step: float,
                legend_format: str = "") -> list[Series]:
    """Every series ``expr`` gives over [start, end]; raises on a PromQL error."""
    r = httpx.get(f"{prometheus}/api/v1/query_range",
                  params={"query": expr, "start": start, "end": end, "step": step}, timeout=30)
    body = r.json()
    if r.status_code != 200 or body.get("status") != "success":
        raise ValueError(f"Prometheus refused {expr!r}: {body.get('error', r.text)}")
    return [Series(legend(legend_format, s["metric"]), [float(t) for t, _ in s["values"]],
                   [float(v) for _, v in s["values"]])  # "NaN" and "+Inf" parse as floats
            for s in body["data"]["result"]]


def has_numbers(series: list[Series]) -> bool:
    """Whether any point of any series is a number (a ratio of two zero rates is NaN)."""
    return any(not math.isnan(v) for s in series for v in s.values)


def label_values(prometheus: str, label: str, metric: str) -> list[str]:
    """Grafana's ``label_values(metric, label)``: the values ``label`` takes on ``metric``'s series."""
    r = httpx.get(f"{prometheus}/api/v1/label/{label}/values", params={"match[]": metric}, timeout=30)
    r.raise_for_status()
    return sorted(r.json()["data"])
