"""The engine process: a multiprocessing transport around an ``EngineCore``, and nothing else.

Commands arrive pickled on a ``multiprocessing.Queue``; step messages leave through a one-way
``Pipe`` written by this process's own thread, so nothing sits between the end of a step and
the bytes leaving the process. The process ignores SIGINT/SIGTERM (its client decides when it
stops, after in-flight requests finish) and exits by itself if its parent dies.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvserve.engine.core import EngineCore
from kvserve.engine.messages import EngineFailed
from kvserve.errors import KVServeError

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

# OpenMP threads that wait at a barrier sleep instead of spinning. Beside the API process (and on a
# 2-core machine it always is beside it), a spinning team loses whole time slices whenever one of its
# threads is preempted, in each of the ~400 parallel regions of a step: measured here, the single
# stream's ITL p50 went 36.5 -> 25.2 ms and 64 streams 114 -> 125 tokens/s with them asleep, and an
# engine alone was no slower. A value set by the user is kept.
ENGINE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
# On an AMX CPU a many-row step leaves OpenMP regions often: the decode stack's linears are oneDNN
# calls between its regions (kvserve.model.native_stack), and prefill runs the Python layers, whose
# ops are bf16 GEMMs, conversions and attention pieces with gaps between them. Sleeping threads made
# a 64-row step slower than the integer kernels (59 vs 53 ms); a spin of 2,000 pauses (~0.1 ms here)
# still slept through the Python path's gaps: c64 429 vs 570 output tok/s, prefix-RAG TTFT p99 3.24
# vs 2.03 s against 10,000 (~0.5 ms), which matched OMP_WAIT_POLICY=ACTIVE; idle threads still sleep
# within a millisecond (docs/benchmarks.md).
AMX_ENGINE_ENV = {"GOMP_SPINCOUNT": "10000"}


def amx_cpu() -> bool:
    """A CPU with AMX-BF16, the AMX paths not turned off (KVSERVE_AMX=0); torch-free, so the CLI can ask
    before OpenMP loads (kvserve.device.amx_gemm_available also asks torch for oneDNN)."""
    from kvserve.kernels.isa import effective_flags

    return os.environ.get("KVSERVE_AMX", "1") != "0" and "amx_bf16" in effective_flags()


def forced_isa_env() -> dict[str, str]:
    """With KVSERVE_CPU_ISA set, torch's oneDNN steps down to the same level, so a forced level's figures are
    the whole engine's at that level, not just kvserve's kernels'."""
    from kvserve.kernels.isa import BY_NAME, ENV

    level = BY_NAME.get(os.environ.get(ENV, "").strip().lower())
    return {"ONEDNN_MAX_CPU_ISA": level.onednn_isa} if level else {}


def apply_engine_env() -> list[str]:
    """Adds to this process's environment the engine's OpenMP settings for this CPU (ENGINE_ENV, or
    AMX_ENGINE_ENV) that the user did not set; a wait policy of the user's also rules out our spin
    count. Returns the names added. The CLI calls it before torch loads (in-process engines, and the
    engine process it spawns inherits them); ``engine_environment`` otherwise."""
    env = dict(AMX_ENGINE_ENV if amx_cpu() else ENGINE_ENV, **forced_isa_env())
    added = [k for k in env if k not in os.environ and not (k == "GOMP_SPINCOUNT" and "OMP_WAIT_POLICY" in os.environ)]
    os.environ.update({k: env[k] for k in added})
    return added


@contextlib.contextmanager
def engine_environment():
    """Around starting an engine process: ``apply_engine_env`` for it (the OpenMP runtime reads the
    environment once, when torch loads in the child), this process's environment unchanged afterwards."""
    added = apply_engine_env()
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


IDLE_POLL_S = 1.0  # an idle engine wakes this often to notice that its parent died
COMPILE_POLL_S = 0.002  # while grammars compile and nothing runs, how often to look for them


def run_engine_process(build: Callable[[Any], EngineCore], config: Any, commands: mp.Queue,
                       outputs: Connection) -> None:
    """Entry point: ``build(config)`` the core, report ready, then serve commands until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    try:
        core = build(config)
        outputs.send(core.ready())
    except BaseException as e:  # noqa: BLE001 - anything that stops start-up goes back to the parent
        _send_failure(outputs, e)
        return
    try:
        _serve(core, commands, outputs)
    except (BrokenPipeError, EOFError):
        pass  # the client is gone
    except BaseException as e:  # noqa: BLE001
        _send_failure(outputs, e)
        raise SystemExit(1) from e


def _serve(core: EngineCore, commands: mp.Queue, outputs: Connection) -> None:
    while True:
        cmds: list[Any] = []
        if not core.has_work:
            try:  # idle: sleep on the queue (briefly while grammars compile), never spin
                cmds.append(pickle.loads(commands.get(timeout=COMPILE_POLL_S if core.is_compiling else IDLE_POLL_S)))
            except queue.Empty:
                if not _parent_alive():
                    return
                if not core.is_compiling:
                    continue
        while True:
            try:
                cmds.append(pickle.loads(commands.get_nowait()))
            except queue.Empty:
                break
        for cmd in cmds:
            if not core.handle(cmd):
                return
        msg = core.step()
        if msg is not None:
            outputs.send(msg)


def _send_failure(outputs: Connection, e: BaseException) -> None:
    user = isinstance(e, KVServeError)
    message = str(e) if user else "".join(traceback.format_exception(e)).rstrip()
    try:
        outputs.send(EngineFailed(message, user))
    except OSError:
        pass


def _parent_alive() -> bool:
    parent = mp.parent_process()
    return parent is None or parent.is_alive()
