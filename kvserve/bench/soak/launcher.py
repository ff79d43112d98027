"""Starting the soak: ``kvserve serve`` in a subprocess of its own, and the command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvserve.bench.soak.report import failed, format_result
from kvserve.bench.soak.run import run_soak
from kvserve.bench.soak.traffic import SoakConfig

_LOG_ERROR = re.compile(r"Traceback|(^|\s)(ERROR|CRITICAL)[:\s]")


class ServeProcess:
    """``kvserve serve --model PATH`` in a subprocess on a free port, its output in a log file."""

    def __init__(self, model: str, serve_args: list[str], log_path: str | None = None, startup_timeout: float = 300):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model, self.serve_args, self.startup_timeout = model, serve_args, startup_timeout
        self.log_path = log_path or tempfile.mkstemp(prefix="kvserve-soak-", suffix=".log")[1]
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None

    def __enter__(self) -> ServeProcess:
        import httpx

        import kvserve

        here = str(Path(kvserve.__file__).resolve().parents[1])  # the server runs this same kvserve
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
        model = [] if self.model == "embedded" else ["--model", self.model]
        cmd = [sys.executable, "-m", "kvserve", "serve", *model, "--port", str(self.port),
               "--uvicorn-log-level", "warning", *self.serve_args]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvserve serve exited with status {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvserve serve did not come up in {self.startup_timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.3)

    def stop(self) -> int | None:
        if self.proc is not None and self.exit_code is None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(60)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.exit_code = self.proc.returncode
            self._log.close()
        return self.exit_code

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def log_errors(self) -> list[str]:
        """Lines of the server's log that say something went wrong (tracebacks, ERROR lines)."""
        try:
            lines = Path(self.log_path).read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [line[:300] for line in lines if _LOG_ERROR.search(line)]


def soak_with_server(cfg: SoakConfig, model: str, serve_args: list[str], log_path: str | None = None,
                     progress: bool = True) -> dict:
    """Start ``kvserve serve`` on ``model``, soak it, stop it (SIGTERM) and add what its log and exit say."""
    with ServeProcess(model, serve_args, log_path) as server:
        cfg.url = server.url
        result = asyncio.run(run_soak(cfg, progress=progress))
        result["server_alive_at_end"] = server.alive
        result["server_exit_code"] = server.stop()
    result["server_log"] = server.log_path
    result["server_log_errors"] = server.log_errors()
    return result


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Soak: mixed traffic against a server for a set time, then the books "
                                             "are checked (see kvserve.bench.soak).",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server")
    where.add_argument("--model", help="start `kvserve serve --model MODEL` (embedded: the default model)")
    ap.add_argument("--serve-args", default="", help="more flags for kvserve serve, e.g. \"--num-kv-blocks 64\"")
    ap.add_argument("--server-log", default=None, help="the started server's log (default: a temporary file)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    ap.add_argument("--concurrency", type=int, default=8, help="clients, each one request at a time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-interval", type=float, default=2.0, help="seconds between /metrics samples")
    ap.add_argument("--warmup", type=float, default=None, help="seconds of warm-up before RSS growth is measured "
                                                                 "(default: a quarter of --duration)")
    ap.add_argument("--max-tokens", type=int, default=64, help="largest max_tokens of ordinary requests (aborted "
                                                                 "streams ask for up to 3x)")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="a request slower than this is an error")
    ap.add_argument("--json-out", default=None, help="write the full result (RSS series included) here")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    cfg = SoakConfig(url=a.url or "", duration=a.duration, concurrency=a.concurrency, seed=a.seed,
                     sample_interval=a.sample_interval, warmup=a.warmup, max_tokens=a.max_tokens,
                     request_timeout=a.request_timeout)
    if a.model:
        result = soak_with_server(cfg, a.model, shlex.split(a.serve_args), a.server_log, progress=not a.quiet)
    else:
        result = asyncio.run(run_soak(cfg, progress=not a.quiet))
    print(format_result(result))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 1 if failed(result) else 0
