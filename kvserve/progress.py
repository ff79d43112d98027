"""Progress bars for long command-line work: a tqdm bar on stderr while stderr is a terminal, nothing
when it is a pipe or a file.

Long functions (a simulation, a calibration level) report through ``expect`` and ``advance`` without
knowing whether a bar is shown: the CLI opens one with ``task`` around the work; outside a task both
are no-ops, so the Python API and the tests stay quiet.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, redirect_stdout
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

    columns, lines = _terminal_size()
    bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not on_terminal(), ncols=columns,
               nrows=lines)
    token = _bar.set(bar)
    above = _LinesAboveTheBar(sys.stdout, bar) if not bar.disable and sys.stdout.isatty() else None
    try:
        with redirect_stdout(above) if above else nullcontext():
            yield
    finally:
        _bar.reset(token)
        if above:
            above.close()
        bar.close()


class _LinesAboveTheBar(io.TextIOBase):
    """stdout while a bar is drawn on the same terminal: whole lines go above the bar instead of
    being written over it (the bar is cleared, the lines written, the bar drawn again)."""

    def __init__(self, out: Any, bar: Any):
        self.out, self.bar, self.pending = out, bar, ""

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            lines, self.pending = self.pending.rsplit("\n", 1)
            self._above(lines + "\n")
        return len(text)

    def _above(self, text: str) -> None:
        self.bar.clear()
        self.out.write(text)
        self.out.flush()
        self.bar.refresh()

    def flush(self) -> None:
        self.out.flush()

    def close(self) -> None:
        if self.pending:
            self._above(self.pending)
            self.pending = ""


def _terminal_size() -> tuple[int, int]:
    """stderr's terminal size; 80 x 24 where it reports 0 (a fresh pseudo-terminal does, and tqdm
    would then hide its bar as outside the screen)."""
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
        return size.columns or 80, size.lines or 24
    except (OSError, ValueError, AttributeError):
        return 80, 24


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
