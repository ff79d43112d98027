"""Build and load the C++ kernels in ``csrc/``: once per machine, cached, with a fallback.

The library is compiled with ``-march=native`` for the CPU it runs on (AVX2 or AVX512 paths
are chosen by the compiler's own macros), so its cache key includes the CPU's model and
flags as well as the sources and torch's version: a different CPU kind gets its own build.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": bool, set once tried


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return "unknown"


def cache_dir() -> Path:
    root = os.environ.get("KVSERVE_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvserve", "kernels")
    return Path(root)


def sources() -> list[Path]:
    return sorted(CSRC.rglob("*.cpp"))


def build_key() -> str:
    h = hashlib.blake2b(digest_size=8)
    h.update(torch.__version__.encode())
    # the checkout too: ninja's build file names the sources by path, so two checkouts sharing one
    # build directory would rebuild each other's library on every load
    h.update(str(CSRC.resolve()).encode())
    h.update(_cpu_signature().encode())
    for src in sorted(CSRC.rglob("*")):
        if src.suffix in (".cpp", ".h"):
            h.update(src.relative_to(CSRC).as_posix().encode())
            h.update(src.read_bytes())
    return h.hexdigest()


def load_kernels(verbose: bool = False) -> bool:
    """Build (if needed) and load the kernels; True when ``torch.ops.kvserve`` has them.

    Set KVSERVE_KERNELS=0 to skip them (every caller then uses its torch fallback).
    """
    with _lock:
        if "loaded" in _state:
            return bool(_state["loaded"])
        _state["loaded"] = ok = _try_load(verbose)
        return ok


STALE_LOCK_S = 600  # a build takes 1-3 minutes; an older lock was left by a killed build


def _clear_stale_lock(build_dir: Path) -> None:
    """torch's build lock is a file that a killed build leaves behind, and every later load would
    wait on it forever: remove one older than any build takes."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("native kernels: removing a build lock left %.0f s ago by a build that did not finish", age)
        lock.unlink(missing_ok=True)


def kernels_available() -> bool:
    return load_kernels()


def _try_load(verbose: bool) -> bool:
    if os.environ.get("KVSERVE_KERNELS", "1") == "0":
        log.info("native kernels: off (KVSERVE_KERNELS=0); using the torch fallbacks")
        return False
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("native kernels: no C++ compiler found (install g++); using the torch fallbacks")
        return False
    try:
        from torch.utils import cpp_extension

        build_dir = cache_dir() / build_key()
        build_dir.mkdir(parents=True, exist_ok=True)
        _clear_stale_lock(build_dir)
        if not (build_dir / "kvserve_kernels.so").exists():
            log.info("native kernels: compiling them for this CPU (once per machine and checkout, 1-3 minutes) ...")
        flags = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only", "-Wno-unused-function"]
        cpp_extension.load(
            name="kvserve_kernels",
            sources=[str(s) for s in sources()],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(CSRC)],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=verbose,
        )
    except Exception as e:  # a failed build must never stop the engine: the fallbacks cover it
        lines = str(e).strip().splitlines()
        errors = [ln.strip() for ln in lines if "error" in ln.lower()] or lines or [type(e).__name__]
        log.warning("native kernels: build failed (%s); using the torch fallbacks", errors[0][:300])
        return False
    log.info("native kernels: loaded (%s)", build_dir)
    return True
