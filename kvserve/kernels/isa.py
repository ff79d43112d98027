"""Instruction-set levels of the native kernels: what each is built with, which CPUs run it, which one runs.

One library is built per level (``kvserve.kernels.build``); at start the best level this CPU can
run is loaded, or the one ``KVSERVE_CPU_ISA`` names (a lower one, to test or compare it). A level
this CPU cannot run is refused in one line. Torch-free: the CLI checks the variable before torch
loads.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from dataclasses import dataclass

from kvserve.cpuinfo import cpu_flags
from kvserve.errors import KVServeError

ENV = "KVSERVE_CPU_ISA"


@dataclass(frozen=True)
class IsaLevel:
    name: str
    compile_flags: tuple[str, ...]
    cpu_flags: frozenset[str]  # the /proc/cpuinfo flags a CPU needs to run the level's library
    onednn_isa: str  # oneDNN's ONEDNN_MAX_CPU_ISA for the same level, so torch's GEMMs step down with it
    needs_tile_permission: bool = False  # AMX: the OS must grant the tile state (arch_prctl)


_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})  # x86-64-v3
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}  # x86-64-v4
_AMX = ("-mamx-tile", "-mamx-int8", "-mamx-bf16", "-mavxvnni")

# Lowest first. Each level's library uses every instruction its compile flags allow; the kernels pick
# their paths from the compiler's macros (__AVX512BF16__, __AMX_TILE__, ...), as -march=native did.
LEVELS: tuple[IsaLevel, ...] = (
    IsaLevel("avx2", ("-march=x86-64-v3",), _V3, "AVX2"),
    IsaLevel("avx512", ("-march=x86-64-v4",), _V4, "AVX512_CORE"),
    IsaLevel("avx512_vnni", ("-march=x86-64-v4", "-mavx512vnni"), _V4 | {"avx512_vnni"}, "AVX512_CORE_VNNI"),
    IsaLevel("avx512_bf16", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
             _V4 | {"avx512_vnni", "avx512_bf16"}, "AVX512_CORE_BF16"),
    IsaLevel("amx", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16") + _AMX,
             _V4 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16", "avx_vnni"},
             "AVX512_CORE_AMX", needs_tile_permission=True),
)
BY_NAME = {level.name: level for level in LEVELS}


class IsaError(KVServeError):
    """KVSERVE_CPU_ISA names no level, or one this CPU cannot run."""


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def tile_permission() -> bool:
    """Whether Linux lets this process use AMX's tile data (it must be asked for: ARCH_REQ_XCOMP_PERM)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        sys_arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
        return libc.syscall(sys_arch_prctl, req_xcomp_perm, xfeature_xtiledata) == 0
    except (OSError, AttributeError):
        return False


def missing(level: IsaLevel, flags: set[str] | None = None) -> list[str]:
    """What this CPU (or ``flags``) lacks to run ``level``; empty when it can."""
    if not is_x86_64():
        return [f"an x86-64 CPU (this is {platform.machine()})"]
    have = cpu_flags() if flags is None else flags
    lacks = sorted(level.cpu_flags - have)
    if not lacks and level.needs_tile_permission and flags is None and not tile_permission():
        lacks.append("the OS's permission for AMX tile data (arch_prctl)")
    return lacks


def best_level(flags: set[str] | None = None) -> IsaLevel | None:
    """The highest level this CPU runs; None where none does (not x86-64, or no AVX2): the torch path."""
    runnable = [level for level in LEVELS if not missing(level, flags)]
    return runnable[-1] if runnable else None


def chosen_level() -> IsaLevel | None:
    """``KVSERVE_CPU_ISA``'s level when set (raising IsaError when this CPU cannot run it), else the best."""
    name = os.environ.get(ENV, "").strip().lower()
    if not name:
        return best_level()
    if name not in BY_NAME:
        raise IsaError(f"{ENV}={name} is not a level: choose one of {', '.join(BY_NAME)}")
    level = BY_NAME[name]
    lacks = missing(level)
    if lacks:
        raise IsaError(f"{ENV}={name}: this CPU cannot run it (it lacks {', '.join(lacks)})")
    return level


def effective_flags() -> set[str]:
    """This CPU's flags as the engine should see them: with KVSERVE_CPU_ISA set, without the flags only the
    levels above it need (so a forced AVX512 level also keeps the AMX and bf16 paths of torch's side off)."""
    flags = set(cpu_flags())
    name = os.environ.get(ENV, "").strip().lower()
    if name in BY_NAME:
        above = set().union(*(lv.cpu_flags for lv in LEVELS[LEVELS.index(BY_NAME[name]) + 1:]))
        flags -= above - BY_NAME[name].cpu_flags
    return flags
