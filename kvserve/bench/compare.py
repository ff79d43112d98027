"""``kvserve bench compare``: one workload against several servers in turn, side by side.

The servers run the identical workload (same seed, so the same prompts and arrivals) one after
another, never at once, so they do not share the machine's cores while measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from kvserve.bench import datasets, report
from kvserve.bench import serve as bench_serve
from kvserve.bench.serve import Interference, RequestRecord, Summary
from kvserve.bench.stats import Dist
from kvserve.errors import InvalidArgumentError


def add_args(p: argparse.ArgumentParser) -> None:
    bench_serve.add_args(p)
    p.add_argument("--servers", required=True, nargs="+",
                   help="name=url pairs, comma- or space-separated, e.g. kvserve=http://127.0.0.1:8000")
    p.add_argument("--output-md", default=None, help="write the side-by-side markdown table here")


def parse_servers(items: list[str]) -> dict[str, str]:
    servers: dict[str, str] = {}
    for item in (x for arg in items for x in arg.split(",") if x):
        name, sep, url = item.partition("=")
        if not sep or not name or not url:
            raise InvalidArgumentError(f"--servers expects name=url, got {item!r}")
        if name in servers:
            raise InvalidArgumentError(f"--servers names {name!r} twice")
        servers[name] = url
    return servers


def run(a: argparse.Namespace) -> dict[str, Summary]:
    servers = parse_servers(a.servers)
    report.check_plot_available(a.plot)
    workload = datasets.build(a)
    summaries: dict[str, Summary] = {}
    runs: dict[str, list[RequestRecord]] = {}
    for name, url in servers.items():
        a.base_url = url
        summaries[name], runs[name] = asyncio.run(bench_serve.run_workload(a, workload))
        print(f"[{name}]\n" + report.format_summary(summaries[name]))
    md = report.compare_markdown(summaries)
    print(md)
    if a.output_md:
        with open(a.output_md, "w") as f:
            f.write(md)
    if a.plot:
        report.plot(runs, a.plot)
    return summaries


def table(items: list[str]) -> str:
    """``kvserve bench table``: the side-by-side markdown of results saved by earlier runs."""
    paths = parse_servers(items)  # the same name=value form
    try:
        return report.compare_markdown({name: load_summary(p) for name, p in paths.items()})
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidArgumentError(f"cannot read a saved result: {e}") from e


def load_summary(path: str) -> Summary:
    """A Summary back from a ``--save-result`` JSON file."""
    with open(path) as f:
        d = json.load(f)["summary"]
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d[k] = Dist(**d[k]) if d.get(k) else None
    d["interference"] = Interference(**d["interference"]) if d.get("interference") else None
    return Summary(**d)
