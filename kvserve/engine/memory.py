"""Memory: this process's resident set, cheaply enough to read once per step; the CPU's KV pool cap."""

from __future__ import annotations

import os

_statm: tuple[int, int] | None = None  # (pid, fd of its /proc/self/statm): one pread per snapshot


def resident_memory_bytes() -> int | None:
    """This process's resident set size from /proc/self/statm; None where there is no /proc (not Linux)."""
    global _statm
    try:
        if _statm is None or _statm[0] != os.getpid():  # a forked child reopens its own
            _statm = (os.getpid(), os.open("/proc/self/statm", os.O_RDONLY))
        return int(os.pread(_statm[1], 128, 0).split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def cpu_kv_cap_bytes() -> int:
    """The most a CPU server's default KV pool takes: a quarter of available memory, at most 4 GiB
    (``kvserve.runner.kv_budget``'s cap, computed here without torch for ``serve --replicas``)."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        avail = info.get("MemAvailable", 8 << 30)
    except (OSError, ValueError, IndexError):
        avail = 8 << 30
    return int(min(4 << 30, avail // 4))
