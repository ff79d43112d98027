"""The router's settings (``RouterConfig``) and the flags of ``kvserve router``."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from kvserve.config import DEFAULT_MAX_REQUEST_BYTES, TOOL_CALL_PARSERS
from kvserve.errors import InvalidArgumentError
from kvserve.router.policy import DEFAULT_MAX_IMBALANCE, POLICIES


@dataclass
class RouterConfig:
    backends: list[str] = field(default_factory=list)
    prefill: list[str] = field(default_factory=list)  # disaggregated: prefill replicas (kvserve.router.disagg)
    decode: list[str] = field(default_factory=list)  # and decode replicas, with ``backends``
    policy: str = "cache-aware"
    max_load_imbalance: int = DEFAULT_MAX_IMBALANCE
    model: str | None = None  # whose tokenizer: the replicas' model (None: the embedded one)
    tool_call_parser: str = "auto"  # as the replicas' --tool-call-parser (chat prompts with tools)
    host: str = "127.0.0.1"
    port: int = 8080
    health_interval_s: float = 1.0
    fail_after: int = 2
    events_wait_s: float = 1.0
    max_attempts: int = 3
    connect_timeout_s: float = 3.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    admin_key: str | None = None
    backend_api_key: str | None = None  # the replicas' --api-key, for GET /kv/events and /kv/transfer
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidArgumentError(f"--policy must be one of {', '.join(POLICIES)}", param="policy")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise InvalidArgumentError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}",
                                       param="tool_call_parser")
        if bool(self.prefill) != bool(self.decode):
            raise InvalidArgumentError("--prefill and --decode go together: a split needs replicas of both roles",
                                       param="prefill")
        for name in ("max_load_imbalance", "max_attempts", "fail_after"):
            if getattr(self, name) < (0 if name == "max_load_imbalance" else 1):
                raise InvalidArgumentError(f"--{name.replace('_', '-')} is too small", param=name)
        for name in ("health_interval_s", "events_wait_s", "connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(f"--{name.replace('_', '-')} must be positive", param=name)


def add_args(p: argparse.ArgumentParser) -> None:
    d = RouterConfig()
    p.add_argument("--backend", dest="backends", action="append", default=[], metavar="URL",
                   help="a kvserve server, e.g. http://127.0.0.1:8001 (repeatable; more via POST /admin/backends)")
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a `kvserve serve --role prefill` replica (repeatable; with --decode: disaggregated prefill, "
                        "prefill replicas chosen by --policy, decode replicas by load)")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a `kvserve serve --role decode` replica (repeatable)")
    p.add_argument("--policy", default=d.policy, choices=POLICIES,
                   help="cache-aware: the longest cached prefix within the load bound; least-load; round-robin; "
                        "session: X-Session-Id or `user` sticks to a backend (default: %(default)s)")
    p.add_argument("--max-load-imbalance", type=int, default=d.max_load_imbalance,
                   help="cache-aware: a backend may hold this many more requests than the least loaded one and still "
                        "get a request for its cache (default: %(default)s)")
    p.add_argument("--model", default=None,
                   help="the replicas' model, for its tokenizer (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--tool-call-parser", default=d.tool_call_parser, choices=TOOL_CALL_PARSERS,
                   help="as the replicas' --tool-call-parser (how chat prompts with tools are rendered)")
    p.add_argument("--host", default=d.host, help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="port to listen on (default: %(default)s)")
    p.add_argument("--health-interval-s", type=float, default=d.health_interval_s,
                   help="seconds between health checks of each backend (default: %(default)s)")
    p.add_argument("--fail-after", type=int, default=d.fail_after,
                   help="failed health checks in a row that take a backend out (default: %(default)s; a refused "
                        "connection takes it out at once)")
    p.add_argument("--events-wait-s", type=float, default=d.events_wait_s,
                   help="long-poll wait of GET /kv/events (default: %(default)s)")
    p.add_argument("--max-attempts", type=int, default=d.max_attempts,
                   help="backends tried per request before giving up (default: %(default)s)")
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help="largest request body, 413 above (default: 8 MiB)")
    p.add_argument("--admin-key", default=os.environ.get("KVSERVE_ROUTER_ADMIN_KEY"),
                   help="require `Authorization: Bearer KEY` on /admin routes (default: $KVSERVE_ROUTER_ADMIN_KEY)")
    p.add_argument("--backend-api-key", default=os.environ.get("KVSERVE_API_KEY"),
                   help="the replicas' --api-key, which their GET /kv/events and /kv/transfer need (default: $KVSERVE_API_KEY; "
                        "clients' own Authorization headers are passed on to the replicas as they are)")
    p.add_argument("--log-level", default=d.log_level,
                   choices=("critical", "error", "warning", "info", "debug", "trace"))


def from_args(a: argparse.Namespace) -> RouterConfig:
    return RouterConfig(backends=list(a.backends), prefill=list(a.prefill), decode=list(a.decode), policy=a.policy, max_load_imbalance=a.max_load_imbalance,
                        model=a.model, tool_call_parser=a.tool_call_parser, host=a.host, port=a.port,
                        health_interval_s=a.health_interval_s, fail_after=a.fail_after, events_wait_s=a.events_wait_s,
                        max_attempts=a.max_attempts, max_request_bytes=a.max_request_bytes, admin_key=a.admin_key,
                        backend_api_key=a.backend_api_key, log_level=a.log_level)
