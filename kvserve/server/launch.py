"""``kvserve serve``: bind the socket, start the engine, run uvicorn, and stop cleanly.

A SIGTERM is a graceful stop (exit 0); an engine process that dies stops the server with
EngineDeadError (a non-zero exit), so that a supervisor restarts it.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

from kvserve.config import ServerConfig
from kvserve.errors import EngineDeadError, InvalidArgumentError
from kvserve.server.app import create_app
from kvserve.server.engine_client import EngineClient

log = logging.getLogger("kvserve.server")

ENGINE_WATCH_INTERVAL_S = 0.5


def serve(client_factory: Callable[[], EngineClient], config: ServerConfig) -> None:
    """Bind, start the engine, and serve until SIGINT/SIGTERM.

    SIGTERM (and a first Ctrl-C) stop accepting connections, let requests in flight finish
    (for at most ``config.graceful_shutdown_timeout`` seconds), stop the engine, and return. If the engine
    process dies, the requests in it get an error, /health says 503, and the server stops and
    raises EngineDeadError (the CLI exits non-zero), so that a supervisor restarts it.
    """
    import uvicorn

    host, port = config.host, config.port
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))  # before loading the model: a busy port fails fast
    except OSError as e:
        sock.close()
        raise InvalidArgumentError(f"cannot listen on {host}:{port}: {e.strerror}", param="port") from e
    client = client_factory()
    died = threading.Event()
    try:
        app = create_app(client, config)
        uv_config = uvicorn.Config(app, log_level=config.uvicorn_log_level,
                                   timeout_graceful_shutdown=config.graceful_shutdown_timeout,
                                   timeout_keep_alive=5)
        server = uvicorn.Server(uv_config)

        def watch_engine() -> None:
            while not server.should_exit:
                if not client.is_alive:
                    died.set()
                    log.error("the engine process died: stopping the server (non-zero exit) so that a supervisor "
                              "restarts it")
                    server.should_exit = True
                    return
                died.wait(ENGINE_WATCH_INTERVAL_S)
            app.state.server.stopping = True  # endless streams (the page's live view) end within a tick

        threading.Thread(target=watch_engine, name="engine-watch", daemon=True).start()
        names = ", ".join(app.state.server.names)
        log.info("serving %s on http://%s:%d (OpenAI API under /v1%s)", names, host, port,
                 "; the web page at /" if config.ui else "")
        run_until_stopped(server, sock)
    finally:
        sock.close()
        if client.is_alive:
            client.shutdown()
    if died.is_set():
        raise EngineDeadError("the engine process died; the server stopped")


def run_until_stopped(server: Any, sock: socket.socket) -> None:
    """Serve on ``sock`` until uvicorn stops. uvicorn re-raises the signal that stopped it once it is
    done; a no-op handler for SIGTERM turns that into a normal return, so a graceful stop exits 0."""
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
