"""The CPU's feature flags, without torch: the CLI reads them to set OpenMP's environment before
torch (and with it OpenMP) loads (kvserve.engine.worker.engine_env)."""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none: not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
