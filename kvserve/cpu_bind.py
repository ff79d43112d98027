"""``--cpu-bind``: which CPUs an engine's threads run on (torch-free: the replica launcher uses it too).

A CPU list ("0-7,16"), ``numa:N`` (the CPUs of NUMA node N), or, with ``--replicas``, ``auto``: each replica
gets its own cores, whole NUMA nodes first, so that no two replicas' OpenMP teams share a core and each reads
its weights from its own node's memory. Without it the kernel's scheduler places the threads, and on a
many-core, multi-socket server one engine's team spreads across nodes.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvserve.errors import InvalidArgumentError

NODES = Path("/sys/devices/system/node")


def available_cpus() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def parse_cpu_list(text: str) -> list[int]:
    """"0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11]; ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if first < 0 or last < first:
            raise ValueError(part)
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def numa_nodes() -> list[list[int]]:
    """Each NUMA node's CPUs that this process may use (nodes without any left out); one node of every
    available CPU where the kernel shows none."""
    mine = set(available_cpus())
    nodes = []
    for node in sorted(NODES.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = [c for c in parse_cpu_list((node / "cpulist").read_text()) if c in mine]
        except (OSError, ValueError):
            continue
        if cpus:
            nodes.append(cpus)
    return nodes or [sorted(mine)]


def resolve_cpu_bind(spec: str | None) -> list[int] | None:
    """The CPUs ``--cpu-bind spec`` names (None: no pinning; "auto" outside --replicas pins nothing either).
    Raises InvalidArgumentError, in one line, for a malformed list, an unknown node or a CPU not available."""
    if spec is None or spec in ("", "none", "auto"):
        return None
    if spec.startswith("numa:"):
        nodes = numa_nodes()
        try:
            return nodes[int(spec[5:])]
        except (ValueError, IndexError):
            raise InvalidArgumentError(f"--cpu-bind {spec}: this machine has NUMA nodes 0-{len(nodes) - 1}",
                                       param="cpu_bind") from None
    try:
        cpus = parse_cpu_list(spec)
    except ValueError:
        raise InvalidArgumentError(f"--cpu-bind {spec!r}: expected a CPU list such as 0-3,8, numa:N, auto or none",
                                   param="cpu_bind") from None
    missing = sorted(set(cpus) - set(available_cpus()))
    if missing:
        raise InvalidArgumentError(f"--cpu-bind {spec}: CPU {format_cpu_list(missing)} is not available here "
                                   f"(available: {format_cpu_list(available_cpus())})", param="cpu_bind")
    return cpus


def split_for_replicas(n: int, nodes: list[list[int]] | None = None) -> list[list[int]]:
    """``n`` disjoint CPU sets, one per replica: with n a multiple of the node count, each node's CPUs are cut
    into n / nodes equal parts (a replica never spans two nodes); otherwise the CPUs in node order are cut
    into n contiguous parts."""
    nodes = numa_nodes() if nodes is None else nodes
    if n % len(nodes) == 0:
        per = n // len(nodes)
        if all(len(cpus) >= per for cpus in nodes):
            return [cpus[len(cpus) * i // per : len(cpus) * (i + 1) // per] for cpus in nodes for i in range(per)]
    every = [c for cpus in nodes for c in cpus]
    if n > len(every):
        raise InvalidArgumentError(f"--cpu-bind auto: {n} replicas need a CPU each, {len(every)} are available",
                                   param="cpu_bind")
    return [every[len(every) * i // n : len(every) * (i + 1) // n] for i in range(n)]


def bind(cpus: list[int]) -> None:
    """This thread, and every thread it starts from now on (the OpenMP team), on ``cpus``."""
    os.sched_setaffinity(0, cpus)
