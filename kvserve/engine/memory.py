"""The resident memory of this process, cheaply enough to read once per step."""

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
