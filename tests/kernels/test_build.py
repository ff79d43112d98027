"""The native kernels build on a machine with g++, and a machine without one falls back cleanly."""

import os
import shutil
import subprocess
import sys

import pytest


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_kernels_build_and_report_their_vector_path():
    import torch

    from kvserve.kernels import load_kernels

    assert load_kernels()
    assert torch.ops.kvserve.simd_level() in ("avx512", "avx2", "scalar")
    isa = torch.ops.kvserve.isa()  # the instruction set asked for (KVSERVE_ISA), else "native"
    assert isinstance(isa, str) and isa


def _load_in_subprocess(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    code = "import logging,sys;logging.basicConfig();from kvserve.kernels import load_kernels;print(load_kernels())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_kernels_can_be_switched_off():
    r = _load_in_subprocess({"KVSERVE_KERNELS": "0"})
    assert r.stdout.strip() == "False"


def test_missing_compiler_falls_back_with_one_clear_line(tmp_path):
    r = _load_in_subprocess({"CXX": "/nonexistent/c++", "KVSERVE_KERNEL_CACHE": str(tmp_path)})
    assert r.stdout.strip() == "False"
    assert "no C++ compiler" in r.stderr and "torch fallbacks" in r.stderr


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, caplog):
    import time

    from kvserve.kernels import build

    lock = tmp_path / "lock"
    lock.touch()
    build._clear_stale_lock(tmp_path)  # a build may be running right now: wait for it
    assert lock.exists()
    old = time.time() - build.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    with caplog.at_level("WARNING"):
        build._clear_stale_lock(tmp_path)  # left by a killed build: every later load would hang
    assert not lock.exists() and "build lock" in caplog.text


def test_each_checkout_has_its_own_build(monkeypatch, tmp_path):
    from kvserve.kernels import build

    here = build.build_key()
    other = tmp_path / "csrc"
    shutil.copytree(build.CSRC, other)
    monkeypatch.setattr(build, "CSRC", other)
    assert build.build_key() != here  # same sources, another path: ninja would rebuild on every switch
