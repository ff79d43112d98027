"""Load the native kernels once per process: the chosen level's library, from the first place that has it.

The places, in order: the package's prebuilt libraries (a wheel), the build cache (``python -m
kvserve.kernels`` or an earlier start on this machine), a compile now (a checkout whose sources
changed). Wherever none works, callers keep their pure-torch fallbacks after one clear log line.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from kvserve.kernels.build import LIBRARY, BuildError, build_dir, build_levels, compiler, prebuilt_library
from kvserve.kernels.isa import IsaLevel, chosen_level

log = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": bool, "level": IsaLevel | None, "source": str


def load_kernels(verbose: bool = False) -> bool:
    """Load the library of the chosen level (building it if needed); True when ``torch.ops.kvserve`` has
    the ops. KVSERVE_KERNELS=0 skips them. Raises IsaError when KVSERVE_CPU_ISA names a level this
    CPU cannot run."""
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _try_load(verbose)
        return bool(_state["loaded"])


def kernels_available() -> bool:
    return load_kernels()


def loaded_level() -> str | None:
    """The level whose library this process runs (None: the torch fallbacks)."""
    load_kernels()
    level = _state.get("level")
    return level.name if isinstance(level, IsaLevel) and _state["loaded"] else None


def loaded_from() -> str | None:
    """Where the library came from: prebuilt, cached or compiled (None: not loaded)."""
    load_kernels()
    return str(_state["source"]) if _state["loaded"] else None


def _find_or_build(level: IsaLevel, verbose: bool) -> tuple[Path, str]:
    prebuilt = prebuilt_library(level)
    if prebuilt is not None:
        return prebuilt, "prebuilt"
    cached = build_dir(level) / LIBRARY
    if cached.exists():
        return cached, "cached"
    if compiler() is None:
        raise BuildError("no C++ compiler found (install g++, or a kvserve wheel built for this torch)")
    log.info("native kernels: compiling the %s library (once per machine and source change, 1-3 minutes) ...",
             level.name)
    return build_levels([level], verbose=verbose)[level.name], "compiled"


def _try_load(verbose: bool) -> bool:
    level = chosen_level()  # an impossible KVSERVE_CPU_ISA raises, before anything is loaded
    _state["level"] = level
    if os.environ.get("KVSERVE_KERNELS", "1") == "0":
        log.info("native kernels: off (KVSERVE_KERNELS=0); using the torch fallbacks")
        return False
    if level is None:
        log.info("native kernels: none for this CPU (they need x86-64 with AVX2); using the torch fallbacks")
        return False
    try:
        import torch

        path, source = _find_or_build(level, verbose)
        torch.ops.load_library(str(path))
    except Exception as e:  # a failed build or load must never stop the engine: the fallbacks cover it
        lines = str(e).strip().splitlines() or [type(e).__name__]
        log.warning("native kernels: %s (%s); using the torch fallbacks", lines[0][:300], level.name)
        return False
    _state["source"] = source
    log.info("native kernels: %s, %s (%s)", level.name, source, path)
    return True
