"""Memory: this process's resident set, cheaply enough to read once per step; available host memory
and the CPU's cap on the default KV pool (torch-free, for ``serve --replicas`` too)."""

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


GiB = 1 << 30
CPU_CAP_BYTES = 4 * GiB  # the default KV pool's ceiling on a CPU
CPU_FREE_FRACTION = 0.25  # ... and its share of available memory


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo; 8 GiB where there is none (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 8 * GiB


def cpu_kv_cap_bytes(avail: int | None = None) -> int:
    """The most a CPU server's default KV pool takes: a quarter of available memory, at most 4 GiB
    (``kvserve.runner.kv_budget`` sizes the pool with it; ``serve --replicas`` divides it, torch-free)."""
    avail = available_host_bytes() if avail is None else avail
    return min(CPU_CAP_BYTES, int(avail * CPU_FREE_FRACTION))
