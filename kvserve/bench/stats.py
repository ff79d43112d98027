"""The statistics every benchmark, the soak and the simulator report: percentiles, mean, median, ``Dist``."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100), interpolated linearly between ranks like numpy's default; NaN if empty."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(values: Iterable[float]) -> float:
    """The middle value, or the mean of the two middle ones."""
    return statistics.median(values)


def mean(values: Iterable[float]) -> float:
    return statistics.fmean(values)


@dataclass
class Dist:
    """A latency distribution in milliseconds."""
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, seconds: list[float]) -> Dist | None:
        """The distribution of ``seconds`` in ms, rounded to 0.01 ms; None if there are none."""
        if not seconds:
            return None
        ms = [v * 1e3 for v in seconds]
        return cls(round(mean(ms), 2), round(percentile(ms, 50), 2), round(percentile(ms, 90), 2),
                   round(percentile(ms, 99), 2))
