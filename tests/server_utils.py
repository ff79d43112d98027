"""Helpers for the server tests: uvicorn in a thread on a free port, `kvserve serve` in a subprocess,
waiting for /metrics values.

(Event streams are read with kvserve.bench.sse, metric values with kvserve.bench.prometheus.)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

import kvserve
from kvserve.bench.prometheus import metric
from kvserve.config import ServerConfig
from kvserve.server.app import create_app
from kvserve.server.engine_client import AsyncEngineClient


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def spawn_serve(*flags: str, log: Path | None = None, timeout: float = 90.0) -> tuple[subprocess.Popen, str]:
    """`kvserve serve --port <free port> *flags` in a subprocess that imports this same kvserve, once
    /health answers: (process, url). Its output goes to ``log`` (a path) or a text pipe."""
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    url = f"http://127.0.0.1:{port}"
    here = str(Path(kvserve.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    out = open(log, "w") if log is not None else subprocess.PIPE
    proc = subprocess.Popen([sys.executable, "-m", "kvserve", "serve", "--port", str(port), *flags],
                            env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    if log is not None:
        out.close()  # the child holds its own copy
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            output = log.read_text() if log is not None else proc.stdout.read()
            raise AssertionError(f"kvserve serve exited with {proc.returncode}: {output[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"kvserve serve did not answer /health in {timeout:.0f} s")
        time.sleep(0.2)


class AppThread:
    """Any ASGI app served by uvicorn in a daemon thread on a free 127.0.0.1 port."""

    def __init__(self, app):
        self.app = app
        self.sock = free_socket()
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


class ServerThread(AppThread):
    """kvserve's app over ``client``, served as an ``AppThread``; leaving it also stops the engine."""

    def __init__(self, client: AsyncEngineClient, config: ServerConfig | None = None):
        self.client = client
        super().__init__(create_app(client, config))

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self.client.is_alive:  # the lifespan did not run to its end
            self.client._kill()


TINY_ENGINE = dict(dtype="float32", num_threads=1, num_kv_blocks=512, max_num_seqs=64, max_num_batched_tokens=512)


def tiny_server(model_dir) -> ServerThread:
    """A server on the tiny random Llama of ``tiny_model_dir`` (served as "tiny"), for ``with``."""
    from kvserve.config import KVServeConfig

    client = AsyncEngineClient(KVServeConfig.from_kwargs(model=str(model_dir), **TINY_ENGINE))
    return ServerThread(client, ServerConfig(served_model_names=["tiny"]))


def wait_for_metrics(url: str, timeout: float = 15.0, headers: dict | None = None, **expected: float) -> str:
    """Poll /metrics until every ``name=value`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{url}/metrics", headers=headers).text
        values = {k: metric(text, k) for k in expected}
        if values == expected or time.monotonic() > deadline:
            assert values == expected, values
            return text
        time.sleep(0.05)
