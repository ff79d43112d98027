"""Memory: this process's resident set, cheaply enough to read once per step, and the default KV pool size."""

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


def default_kv_cache_bytes() -> int:
    """Without --kv-cache-memory-gb: a quarter of available memory, at most 4 GiB."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        avail = info.get("MemAvailable", 8 << 30)
    except OSError:
        avail = 8 << 30
    return int(min(4 << 30, avail // 4))
