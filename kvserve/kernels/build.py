"""Compile the C++ kernels in ``csrc/``: one shared library per instruction-set level.

A library is keyed by what decides its bytes: the sources, torch's version (its headers and ABI)
and the level's flags. Not by the checkout's path or the CPU: two checkouts of the same sources
share one build, and any CPU can build every level (a level is only *run* where the CPU has it).
The sources are copied into the build folder, so its ninja file names paths that never move.

Builds land in a cache folder (``KVSERVE_KERNEL_CACHE``, else ~/.cache/kvserve/kernels); the
wheel's build copies them into the package (``prebuilt_dir()``), so an installed wheel never
compiles.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from kvserve.kernels.isa import LEVELS, IsaLevel

CSRC = Path(__file__).parent / "csrc"
LIBRARY = "kvserve_kernels.so"
MANIFEST = "manifest.json"
COMMON_FLAGS = ("-O3", "-fopenmp", "-ffast-math", "-fno-finite-math-only", "-Wno-unused-function", "-fPIC",
                "-std=c++20")
PRECOMPILED = ("ATen/ATen.h", "ATen/Parallel.h", "torch/library.h")  # what csrc/common/common.h includes


class BuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("KVSERVE_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvserve", "kernels")
    return Path(root)


def prebuilt_dir() -> Path:
    """Where a wheel carries its libraries: lib/<level>/kvserve_kernels.so and lib/manifest.json."""
    return Path(__file__).parent / "lib"


def sources(root: Path | None = None) -> list[Path]:
    """Every C++ source and header under ``root`` (default: csrc/), in a stable order."""
    return sorted(p for p in (root or CSRC).rglob("*") if p.suffix in (".cpp", ".h"))


def torch_version() -> str:
    """torch's public version: a CPU and a CUDA build of one release share the CPU ops' ABI."""
    import torch

    return torch.__version__.split("+")[0]


def build_key(level: IsaLevel, torch_ver: str | None = None) -> str:
    h = hashlib.blake2b(digest_size=8)
    h.update((torch_ver or torch_version()).encode())
    h.update(" ".join(COMMON_FLAGS + level.compile_flags).encode())
    for src in sources():
        h.update(src.relative_to(CSRC).as_posix().encode())
        h.update(src.read_bytes())
    return h.hexdigest()


def build_dir(level: IsaLevel) -> Path:
    return cache_dir() / f"{level.name}-{build_key(level)}"


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def _torch_flags() -> tuple[list[str], list[str]]:
    import torch
    from torch.utils import cpp_extension

    cflags = [f"-isystem{p}" for p in cpp_extension.include_paths()]
    cflags.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
    ldflags = [f"-L{p}" for p in cpp_extension.library_paths()] + ["-lc10", "-ltorch_cpu", "-ltorch"]
    return cflags, ldflags


def _write_ninja(folder: Path, levels: list[IsaLevel], cxx: str) -> list[str]:
    """One ninja file that builds every level's library from the copied sources; returns the targets."""
    tcflags, ldflags = _torch_flags()
    lines = ["ninja_required_version = 1.3", f"cxx = {cxx}", f"tcflags = {' '.join(tcflags)} -Isrc",
             f"ldflags = -shared -fopenmp {' '.join(ldflags)}", "",
             "rule cxx", "  command = $cxx -MMD -MF $out.d $tcflags $cflags -c $in -o $out",
             "  depfile = $out.d", "  deps = gcc", "",
             "rule pch", "  command = $cxx -MMD -MF $out.d $tcflags $cflags -x c++-header $in -o $out",
             "  depfile = $out.d", "  deps = gcc", "",
             "rule link", "  command = $cxx $in $ldflags -o $out", ""]
    targets = []
    for level in levels:
        flags = " ".join(COMMON_FLAGS + level.compile_flags + (f'-DKVSERVE_ISA=\\"{level.name}\\"',))
        # torch's headers parsed once per level, not once per source (5 of a source's 2-12 s)
        header = folder / "pch" / level.name / "torch_headers.h"
        header.parent.mkdir(parents=True)
        header.write_text("".join(f"#include <{h}>\n" for h in PRECOMPILED))
        gch = f"pch/{level.name}/torch_headers.h.gch"
        lines += [f"build {gch}: pch pch/{level.name}/torch_headers.h", f"  cflags = {flags}"]
        flags += f" -Winvalid-pch -include pch/{level.name}/torch_headers.h"
        objs = []
        for src in sources(folder / "src"):
            if src.suffix != ".cpp":
                continue
            rel = src.relative_to(folder / "src").with_suffix(".o").as_posix()
            obj = f"obj/{level.name}/{rel}"
            lines += [f"build {obj}: cxx src/{src.relative_to(folder / 'src').as_posix()} | {gch}",
                      f"  cflags = {flags}"]
            objs.append(obj)
        target = f"{level.name}/{LIBRARY}"
        lines += [f"build {target}: link {' '.join(objs)}", ""]
        targets.append(target)
    (folder / "build.ninja").write_text("\n".join(lines) + "\n")
    return targets


def _ninja() -> str:
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja  # the PyPI package, a dependency of kvserve

        return str(Path(ninja.BIN_DIR) / "ninja")
    except ImportError as e:
        raise BuildError("ninja is not installed (pip install ninja)") from e


def build_levels(levels: list[IsaLevel] | None = None, verbose: bool = False) -> dict[str, Path]:
    """Build (or find in the cache) each level's library; returns level name -> library path.

    Levels already in the cache are not rebuilt; the missing ones compile together, in parallel.
    """
    levels = list(LEVELS) if levels is None else levels
    out = {lv.name: build_dir(lv) / LIBRARY for lv in levels}
    if all(p.exists() for p in out.values()):
        return out
    cache_dir().mkdir(parents=True, exist_ok=True)
    # one build at a time per cache (test workers start together); the OS drops the lock of a killed build
    with open(cache_dir() / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        todo = [lv for lv in levels if not out[lv.name].exists()]
        if todo:
            _compile(todo, verbose)
    return out


def _compile(todo: list[IsaLevel], verbose: bool) -> None:
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (install g++)")
    work = cache_dir() / f"build-{os.getpid()}-{time.monotonic_ns()}"
    shutil.copytree(CSRC, work / "src")
    try:
        targets = _write_ninja(work, todo, cxx)
        jobs = str(max(1, os.cpu_count() or 1))
        run = subprocess.run([_ninja(), "-j", jobs, *targets], cwd=work, text=True,
                             stdout=None if verbose else subprocess.PIPE, stderr=subprocess.STDOUT)
        if run.returncode != 0:
            errors = [ln for ln in (run.stdout or "").splitlines() if "error" in ln.lower()]
            raise BuildError((errors or (run.stdout or "ninja failed").strip().splitlines()[-1:])[0][:300])
        for lv in todo:  # publish each library whole: a reader never sees a half-written one
            final = build_dir(lv)
            final.mkdir(parents=True, exist_ok=True)
            tmp = final / f".{LIBRARY}.{os.getpid()}"
            shutil.copy2(work / lv.name / LIBRARY, tmp)
            os.replace(tmp, final / LIBRARY)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_prebuilt(dest: Path, levels: list[IsaLevel] | None = None, verbose: bool = False) -> dict[str, str]:
    """Build every level and copy the libraries into ``dest`` (a wheel's kvserve/kernels/lib) with a
    manifest of the keys they were built for; returns the manifest."""
    levels = list(LEVELS) if levels is None else levels
    built = build_levels(levels, verbose=verbose)
    manifest = {"torch": torch_version(), "keys": {lv.name: build_key(lv) for lv in levels}}
    for lv in levels:
        (dest / lv.name).mkdir(parents=True, exist_ok=True)
        shutil.copy2(built[lv.name], dest / lv.name / LIBRARY)
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def prebuilt_library(level: IsaLevel) -> Path | None:
    """The package's own library for ``level`` if it was built from these sources for this torch."""
    folder = prebuilt_dir()
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    lib = folder / level.name / LIBRARY
    if manifest.get("keys", {}).get(level.name) != build_key(level) or not lib.exists():
        return None
    return lib
