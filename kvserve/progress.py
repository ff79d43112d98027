"""Progress bars for long command-line work: a tqdm bar on stderr while stderr is a terminal, nothing
when it is a pipe or a file.

Long functions (a simulation, a calibration level) report through ``expect`` and ``advance`` without
knowing whether a bar is shown: the CLI opens one with ``task`` around the work; outside a task both
are no-ops, so the Python API and the tests stay quiet.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

_bar: ContextVar[Any] = ContextVar("kvserve_progress_bar", default=None)


def on_terminal() -> bool:
    """Whether progress should be drawn: stderr is a terminal."""
    return sys.stderr.isatty()


@contextmanager
def task(desc: str, unit: str = "it", total: int | None = None) -> Iterator[None]:
    """Show a bar for the work inside; ``expect`` and ``advance`` move it. Off when stderr is not a terminal."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not on_terminal(), dynamic_ncols=True)
    token = _bar.set(bar)
    try:
        yield
    finally:
        _bar.reset(token)
        bar.close()


def expect(n: int) -> None:
    """``n`` more units of work are coming (the bar's total grows as the work is discovered)."""
    bar = _bar.get()
    if bar is not None and not bar.disable:
        bar.total = (bar.total or 0) + n
        bar.refresh()


def advance(n: int = 1) -> None:
    """``n`` units of work are done."""
    bar = _bar.get()
    if bar is not None:
        bar.update(n)
