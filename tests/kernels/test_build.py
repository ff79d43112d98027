"""The native kernels: one library per instruction-set level, built ahead, the right one loaded.

Which level a CPU runs is decided from its flags (torch-free); ``KVSERVE_CPU_ISA`` forces a lower one
and refuses, in one line, one the CPU cannot run; a build is keyed by its sources, not its checkout;
a machine without a compiler falls back cleanly.
"""

import os
import shutil
import subprocess
import sys

import pytest

from kvserve.kernels import isa
from kvserve.kernels.isa import BY_NAME, LEVELS

ZEN4 = set(isa.LEVELS[3].cpu_flags) | {"avx_vnni"}  # AVX512-BF16, no AMX
ICE_LAKE = set(isa.LEVELS[2].cpu_flags)  # AVX512-VNNI only
HASWELL = set(isa.LEVELS[0].cpu_flags)
SAPPHIRE_RAPIDS = set(isa.LEVELS[4].cpu_flags)


@pytest.mark.parametrize("flags, best", [(HASWELL, "avx2"), (ICE_LAKE, "avx512_vnni"), (ZEN4, "avx512_bf16"),
                                         (SAPPHIRE_RAPIDS, "amx"), ({"sse4_2", "avx"}, None)])
def test_the_best_level_follows_the_cpu_flags(flags, best):
    level = isa.best_level(flags)
    assert (level.name if level else None) == best
    # every level up to the best runs there, none above it
    runs = [lv.name for lv in LEVELS if not isa.missing(lv, flags)]
    assert runs == [lv.name for lv in LEVELS[: len(runs)]] and (runs[-1] if runs else None) == best


def test_levels_build_on_each_other():
    for lower, higher in zip(LEVELS, LEVELS[1:]):
        assert lower.cpu_flags < higher.cpu_flags, (lower.name, higher.name)


def test_a_cpu_that_is_not_x86_runs_the_torch_path(monkeypatch):
    monkeypatch.setattr(isa.platform, "machine", lambda: "aarch64")
    assert isa.best_level(SAPPHIRE_RAPIDS) is None
    assert "x86-64" in isa.missing(BY_NAME["avx2"], SAPPHIRE_RAPIDS)[0]


def test_forcing_a_level_picks_it_and_refuses_what_the_cpu_cannot_run(monkeypatch):
    monkeypatch.setenv(isa.ENV, "avx2")
    assert isa.chosen_level().name == "avx2"
    monkeypatch.setenv(isa.ENV, "sse9")
    with pytest.raises(isa.IsaError, match="not a level: choose one of avx2, avx512"):
        isa.chosen_level()
    monkeypatch.setattr(isa, "cpu_flags", lambda: HASWELL)
    monkeypatch.setenv(isa.ENV, "avx512_bf16")
    with pytest.raises(isa.IsaError, match=r"this CPU cannot run it \(it lacks avx512_bf16, avx512_vnni, avx512bw"):
        isa.chosen_level()


def test_the_cli_refuses_a_level_the_cpu_cannot_run_in_one_line():
    impossible = next((lv.name for lv in LEVELS if isa.missing(lv)), "sse9")
    r = subprocess.run([sys.executable, "-m", "kvserve", "generate", "hi"], capture_output=True, text=True,
                       env=dict(os.environ, KVSERVE_CPU_ISA=impossible), timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("kvserve: error: KVSERVE_CPU_ISA=")


def test_a_build_is_keyed_by_its_sources_not_its_checkout(monkeypatch, tmp_path):
    from kvserve.kernels import build

    level = BY_NAME["avx2"]
    here = build.build_key(level)
    other = tmp_path / "csrc"
    shutil.copytree(build.CSRC, other)
    monkeypatch.setattr(build, "CSRC", other)
    assert build.build_key(level) == here  # another checkout of the same sources shares the build
    (other / "common" / "common.h").write_text((other / "common" / "common.h").read_text() + "\n// edited\n")
    assert build.build_key(level) != here
    assert len({build.build_key(lv) for lv in LEVELS}) == len(LEVELS)


def test_prebuilt_libraries_are_used_only_when_built_from_these_sources(monkeypatch, tmp_path):
    import json

    from kvserve.kernels import build

    level = BY_NAME["avx2"]
    monkeypatch.setattr(build, "prebuilt_dir", lambda: tmp_path)
    (tmp_path / level.name).mkdir()
    (tmp_path / level.name / build.LIBRARY).write_bytes(b"\x7fELF")
    (tmp_path / build.MANIFEST).write_text(json.dumps({"keys": {level.name: build.build_key(level)}}))
    assert build.prebuilt_library(level) == tmp_path / level.name / build.LIBRARY
    (tmp_path / build.MANIFEST).write_text(json.dumps({"keys": {level.name: "0" * 16}}))  # other sources or torch
    assert build.prebuilt_library(level) is None
    assert build.prebuilt_library(BY_NAME["avx512"]) is None


def _load_in_subprocess(env_extra: dict[str, str], code: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    code = code or ("import logging,sys;logging.basicConfig(level=logging.INFO);"
                    "from kvserve.kernels import load_kernels;print(load_kernels())")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_the_chosen_level_loads_and_reports_itself():
    import torch

    from kvserve.kernels import load_kernels, loaded_level

    assert load_kernels()
    level = isa.chosen_level()  # the best, unless KVSERVE_CPU_ISA (the per-level CI runs) forces one
    assert loaded_level() == level.name == torch.ops.kvserve.isa()
    assert torch.ops.kvserve.simd_level() == ("avx2" if level.name == "avx2" else "avx512")


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
@pytest.mark.parametrize("level", [lv.name for lv in LEVELS])
def test_a_forced_level_is_the_one_that_runs(level):
    if isa.missing(BY_NAME[level]):
        pytest.skip(f"this CPU cannot run {level}")
    code = ("import logging;logging.basicConfig(level=logging.INFO);import torch;"
            "from kvserve.kernels import load_kernels;assert load_kernels();print(torch.ops.kvserve.isa())")
    r = _load_in_subprocess({isa.ENV: level}, code)
    assert r.returncode == 0 and r.stdout.strip() == level, r.stderr[-2000:]
    assert f"native kernels: {level}, " in r.stderr  # the start-up log names the level


def test_kernels_can_be_switched_off():
    r = _load_in_subprocess({"KVSERVE_KERNELS": "0"})
    assert r.stdout.strip() == "False"


def test_missing_compiler_falls_back_with_one_clear_line(tmp_path):
    r = _load_in_subprocess({"CXX": "/nonexistent/c++", "KVSERVE_KERNEL_CACHE": str(tmp_path)})
    assert r.stdout.strip() == "False"
    assert "no C++ compiler" in r.stderr and "torch fallbacks" in r.stderr
