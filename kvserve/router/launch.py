"""``kvserve router``: load the tokenizer, bind, and serve the router's app with uvicorn until stopped."""

from __future__ import annotations

import logging
import socket

from kvserve.errors import InvalidArgumentError
from kvserve.router.app import create_router_app
from kvserve.router.config import RouterConfig
from kvserve.router.prompt import PromptTokenizer
from kvserve.server.launch import run_until_stopped

log = logging.getLogger("kvserve.router")


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (a busy port is a clear error, before anything slow starts)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise InvalidArgumentError(f"cannot listen on {host}:{port}: {e.strerror}", param="port") from e
    return sock


def run_router(config: RouterConfig, sock: socket.socket | None = None) -> None:
    """Serve the router until SIGINT/SIGTERM (a SIGTERM lets streams in flight finish, then exits 0),
    on ``sock`` if given (already bound to the config's address), else on a socket bound here."""
    import uvicorn

    sock = sock or bind(config.host, config.port)
    if config.log_level not in ("debug", "trace"):  # not a line per health check and events poll
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        prompts = PromptTokenizer.load(config.model, config.tool_call_parser)
        app = create_router_app(config, prompts)
        server = uvicorn.Server(uvicorn.Config(app, log_level=config.log_level, timeout_graceful_shutdown=30,
                                               timeout_keep_alive=5))
        log.info("routing (%s) on http://%s:%d over %d backends: %s", config.policy, config.host, config.port,
                 len(config.backends), ", ".join(config.backends) or "none yet (POST /admin/backends)")
        if config.prefill:
            log.info("disaggregated: prefill on %s; decode on %s", ", ".join(config.prefill),
                     ", ".join(config.decode + config.backends))
        run_until_stopped(server, sock)
    finally:
        sock.close()
