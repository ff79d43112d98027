"""``kvserve serve --ray``: start (or join) a Ray cluster, run the application on Ray Serve, stop cleanly.

Without ``--ray-address`` (or ``$RAY_ADDRESS``) a local Ray cluster is started for the command (no
dashboard) and stopped with it. Serve's HTTP proxy listens on ``--host``/``--port``; Ray's own gRPC
ports listen on every interface (Ray has no setting to bind them to the loopback). SIGINT or SIGTERM shuts Serve down
(replicas stop their engines) and exits 0.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading

from kvserve.config import KVServeConfig
from kvserve.errors import InvalidArgumentError, MissingPackageError
from kvserve.ray_serve.options import RayServeOptions

log = logging.getLogger("kvserve.ray_serve")

APP_NAME = "kvserve"


class MissingRayError(MissingPackageError):
    """``--ray`` without Ray Serve installed."""


def require_ray() -> None:
    """Raise a one-line ``MissingRayError`` unless ``ray[serve]`` can be imported."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as e:
        raise MissingRayError(f"--ray needs Ray Serve, which is not installed ({e.name or e}): "
                              "pip install 'ray[serve]' (or kvserve[ray])") from None


def check_port(host: str, port: int) -> None:
    """Fail fast, before starting Ray, when the port is taken."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise InvalidArgumentError(f"cannot listen on {host}:{port}: {e.strerror}", param="port") from e
    finally:
        sock.close()


def serve_on_ray(config: KVServeConfig, options: RayServeOptions, address: str | None = None) -> None:
    """Serve ``options``' replicas of kvserve with ``config`` on Ray Serve until SIGINT/SIGTERM."""
    require_ray()
    import ray
    from ray import serve

    from kvserve.ray_serve.app import build

    srv = config.server
    check_port(srv.host, srv.port)
    if address is None and not os.environ.get("RAY_ADDRESS"):
        ray.init(include_dashboard=False)  # a cluster of this machine alone, for this command
    else:
        ray.init(address=address)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": srv.host, "port": srv.port})
        serve.run(build(config, options), name=APP_NAME, route_prefix="/")
        log.info("serving %d kvserve replicas on Ray Serve at http://%s:%d (OpenAI API under /v1)",
                 options.num_replicas, srv.host, srv.port)
        stop.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        serve.shutdown()
        ray.shutdown()
