"""``kvserve serve --replicas N``: N ``kvserve serve`` processes on 127.0.0.1 behind the router, in one command.

For machines where several small replicas beat one big one (a CPU: each replica on its share of the
cores). This process binds the serve port first (a busy port fails at once), starts each replica as a
child process (``python -m kvserve serve`` with the same flags, a free port of its own, and its share
of the machine: the resource flags are totals divided among the replicas), waits until every one
answers ``/health``, then serves the router (``kvserve.router.launch``) on the serve port.

A replica that dies while serving is restarted on its port (the router takes it out, then back in).
SIGTERM or SIGINT stops the router first (requests in flight finish), then the replicas (SIGTERM;
SIGKILL past the grace period). The replicas run in their own session, so a terminal's Ctrl-C
reaches only this process, which stops them in that order; on Linux they also get a SIGTERM if
this process dies outright (``PR_SET_PDEATHSIG``), so none is left behind.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace

import httpx

from kvserve.config import PARTS, KVServeConfig
from kvserve.cpu_bind import format_cpu_list, parse_cpu_list, resolve_cpu_bind, split_for_replicas
from kvserve.engine.memory import cpu_kv_cap_bytes
from kvserve.errors import InvalidArgumentError, KVServeError
from kvserve.router.config import RouterConfig
from kvserve.router.launch import bind, run_router

log = logging.getLogger("kvserve.replicas")

READY_POLL_S = 0.25
WATCH_INTERVAL_S = 0.5
RESTART_DELAY_S = 2.0
PORT_RETRIES = 3  # a replica's port taken between choosing it and the replica binding it
# the flags each replica gets from the parent, not copied from its own
PER_REPLICA = ("host", "port", "replica_id", "num_threads", "cpu_bind", "kv_cache_memory_gb", "num_kv_blocks",
               "kv_offload_memory_gb", "kv_offload_dir", "kv_offload_disk_gb")
PR_SET_PDEATHSIG = 1


class ReplicaError(KVServeError):
    """A replica could not be started."""


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def replica_configs(config: KVServeConfig, n: int, cores: int | None = None) -> list[KVServeConfig]:
    """Each replica's config (its host, port and replica id still to be set): ``config``'s, with its
    resources (threads, KV pool, host tier, disk tier) divided by ``n``."""
    cores = cores or available_cores()
    if n < 1:
        raise InvalidArgumentError(f"--replicas must be at least 1, got {n}", param="replicas")
    threads = config.model.num_threads or cores
    if n > threads:
        raise InvalidArgumentError(f"--replicas {n} is more than the {threads} "
                                   f"{'--num-threads' if config.model.num_threads else 'cores here'}: each replica "
                                   "needs a thread of its own", param="replicas")
    cores_of = [None] * n
    if config.model.cpu_bind == "auto":  # each replica its own cores, NUMA node by node
        cores_of = [format_cpu_list(cpus) for cpus in split_for_replicas(n)]
    cache = config.cache
    # without a size, the N pools share what one server's default pool could take at most
    kv_gb = cache.kv_cache_memory_gb or cpu_kv_cap_bytes() / (1 << 30)
    out = []
    for i in range(n):
        c = replace(cache, kv_cache_memory_gb=round(kv_gb / n, 4),
                    num_kv_blocks=max(1, cache.num_kv_blocks // n) if cache.num_kv_blocks else None,
                    kv_offload_memory_gb=cache.kv_offload_memory_gb / n,
                    kv_offload_dir=os.path.join(cache.kv_offload_dir, f"replica-{i}") if cache.kv_offload_dir else None,
                    kv_offload_disk_gb=cache.kv_offload_disk_gb / n)
        model = replace(config.model, num_threads=threads // n, cpu_bind=cores_of[i] or config.model.cpu_bind)
        if cores_of[i] is not None and not config.model.num_threads:
            model = replace(model, num_threads=len(parse_cpu_list(cores_of[i])))
        out.append(replace(config, model=model, cache=c))
    return out


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_taken(port: int) -> bool:
    """Whether something else now listens on (or holds) this loopback port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _pdeathsig() -> object | None:
    """``prctl`` from libc on Linux (a replica asks for SIGTERM when its parent dies), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _pdeathsig()


def _die_with_parent() -> None:  # runs in the child between fork and exec: nothing but the call
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)  # type: ignore[operator]


@dataclass
class Replica:
    """One child ``kvserve serve`` process."""

    index: int
    config: KVServeConfig
    port: int
    proc: subprocess.Popen | None = None
    restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        c = replace(self.config, server=replace(self.config.server, host="127.0.0.1", port=self.port))
        args = c.to_cli_args(tuple(PARTS), skip=("host", "port"))
        return [sys.executable, "-m", "kvserve", "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)]

    def start(self) -> None:
        cpus = resolve_cpu_bind(self.config.model.cpu_bind)
        if cpus is None:
            setup = _die_with_parent
        else:  # pinned from exec on, so its OpenMP runtime counts and places its threads on these CPUs alone
            def setup() -> None:
                _die_with_parent()
                os.sched_setaffinity(0, cpus)
        self.proc = subprocess.Popen(self.argv(), env=self.env, start_new_session=True, preexec_fn=setup)

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()


class ReplicaSet:
    """The replica processes: started, waited for, watched (and restarted), stopped."""

    def __init__(self, configs: list[KVServeConfig], name: str):
        env = dict(os.environ)
        api_key = configs[0].server.api_key  # passed in the environment, never on a command line
        if api_key:
            env["KVSERVE_API_KEY"] = api_key
        else:
            env.pop("KVSERVE_API_KEY", None)
        self.replicas = []
        for i, c in enumerate(configs):
            c = replace(c, server=replace(c.server, replica_id=f"{name}-{i}"))
            self.replicas.append(Replica(i, c, _free_port(), env=env))
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # a restart and the stop never interleave
        self._watcher: threading.Thread | None = None

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def start(self) -> None:
        for r in self.replicas:
            r.start()
        log.info("started %d replicas: %s", len(self.replicas),
                 ", ".join(f"{r.url} (pid {r.proc.pid})" for r in self.replicas if r.proc))

    def wait_ready(self) -> None:
        """Until every replica answers /health with 200; a ReplicaError if one exits first."""
        waiting = list(self.replicas)
        tries = [0] * len(self.replicas)
        with httpx.Client(trust_env=False, timeout=2.0) as http:
            while waiting:
                for r in list(waiting):
                    if r.exit_code is not None and tries[r.index] < PORT_RETRIES and _port_taken(r.port):
                        # the free port it was given was taken before it could bind: another one
                        tries[r.index] += 1
                        old, r.port = r.port, _free_port()
                        log.warning("replica %d could not bind port %d (taken meanwhile): starting it on %d",
                                    r.index, old, r.port)
                        r.start()
                        continue
                    if r.exit_code is not None:
                        raise ReplicaError(f"replica {r.index} ({r.url}) exited with code {r.exit_code} while "
                                           "starting (its log is above)")
                    try:
                        if http.get(f"{r.url}/health").status_code == 200:
                            waiting.remove(r)
                    except httpx.HTTPError:
                        pass
                if waiting:
                    time.sleep(READY_POLL_S)

    def watch(self) -> None:
        """Restart, in a thread, any replica that exits before ``stop``."""
        self._watcher = threading.Thread(target=self._watch, name="kvserve-replicas", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_INTERVAL_S):
            for r in self.replicas:
                code = r.exit_code
                if code is None:
                    continue
                log.error("replica %d (%s) exited with code %s: restarting it in %.0f s", r.index, r.url, code,
                          RESTART_DELAY_S)
                if self._stopping.wait(RESTART_DELAY_S):
                    return
                with self._lock:
                    if self._stopping.is_set():
                        return
                    r.restarts += 1
                    r.start()

    def stop(self, grace_s: float) -> None:
        """SIGTERM every replica (each lets its requests finish), SIGKILL those still up after ``grace_s``."""
        with self._lock:
            self._stopping.set()
        if self._watcher is not None:
            self._watcher.join()
        live = [r.proc for r in self.replicas if r.proc is not None and r.proc.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("replica pid %d did not stop in %.0f s: killing it", p.pid, grace_s)
                p.kill()
                p.wait()


class _Stopped(Exception):
    """SIGTERM before the router started."""


def serve_replicas(config: KVServeConfig, n: int, policy: str = "cache-aware", prefill: int = 0) -> None:
    """``kvserve serve --replicas n``: the replicas, then the router on the serve address, until stopped;
    with ``prefill`` > 0 the first ``prefill`` replicas have ``--role prefill``, the others ``decode``."""
    srv = config.server
    configs = replica_configs(config, n)
    if prefill:
        if not 0 < prefill < n:
            raise InvalidArgumentError(f"--prefill-replicas must be between 1 and --replicas - 1 ({n - 1}), got "
                                       f"{prefill}", param="prefill_replicas")
        configs = [replace(c, cache=replace(c.cache, role="prefill" if i < prefill else "decode"))
                   for i, c in enumerate(configs)]
    sock = bind(srv.host, srv.port)
    replicas = ReplicaSet(configs, srv.replica_id or f"replica-{srv.port}")

    def stop_starting(*_: object) -> None:
        raise _Stopped

    previous = signal.signal(signal.SIGTERM, stop_starting)
    try:
        try:
            replicas.start()
            replicas.wait_ready()
        finally:
            signal.signal(signal.SIGTERM, previous)
        replicas.watch()
        urls = replicas.urls
        router = RouterConfig(backends=[] if prefill else urls, prefill=urls[:prefill] if prefill else [],
                              decode=urls[prefill:] if prefill else [], policy=policy, model=config.model.model,  # ports now final
                              tool_call_parser=srv.tool_call_parser, host=srv.host, port=srv.port,
                              max_request_bytes=srv.max_request_bytes, backend_api_key=srv.api_key,
                              admin_key=srv.api_key, log_level=srv.uvicorn_log_level)
        log.info("%d replicas (%d threads each) ready behind the router", n, configs[0].model.num_threads)
        run_router(router, sock)
    except _Stopped:
        log.info("stopped while the replicas were starting")
    finally:
        sock.close()
        replicas.stop(srv.graceful_shutdown_timeout + 10)
