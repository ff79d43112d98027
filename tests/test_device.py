"""--dtype auto on each kind of CPU: bfloat16 only where the CPU has native bf16 instructions, and
float32 for a model on the integer kernels; the AMX GEMM only where the CPU has AMX."""

import logging

import pytest
import torch

from kvserve.device import amx_gemm_available, cpu_flags, resolve_dtype

AMD_AVX2 = {"fpu", "sse4_2", "avx", "avx2", "fma", "f16c"}
ICE_LAKE = AMD_AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_vbmi2"}  # oneDNN emulates bf16 here
COOPER_LAKE = ICE_LAKE | {"avx512_bf16"}
SAPPHIRE_RAPIDS = COOPER_LAKE | {"amx_tile", "amx_bf16", "amx_int8"}
ZEN4 = AMD_AVX2 | {"avx512f", "avx512_bf16"}


@pytest.mark.parametrize("flags,want", [
    (AMD_AVX2, torch.float32),
    (ICE_LAKE, torch.float32),
    (COOPER_LAKE, torch.bfloat16),
    (SAPPHIRE_RAPIDS, torch.bfloat16),
    (ZEN4, torch.bfloat16),
    (set(), torch.float32),  # no /proc/cpuinfo: the safe choice
])
def test_auto_dtype_follows_the_cpus_native_bf16(flags, want, caplog):
    with caplog.at_level(logging.INFO, logger="kvserve.device"):
        assert resolve_dtype("auto", "cpu", flags) == want
    assert "dtype auto: " + str(want).removeprefix("torch.") in caplog.text  # the start-up log says what and why


def test_an_explicit_dtype_is_kept_and_cuda_auto_is_bfloat16():
    assert resolve_dtype("bfloat16", "cpu", AMD_AVX2) == torch.bfloat16
    assert resolve_dtype("float32", "cpu", SAPPHIRE_RAPIDS) == torch.float32
    assert resolve_dtype("auto", "cuda", set()) == torch.bfloat16


def test_this_machines_flags_are_read():
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo")
    assert "sse2" in flags or "fp" in flags or "asimd" in flags  # x86 or ARM: some flag we know


@pytest.mark.parametrize("flags", [AMD_AVX2, ICE_LAKE, SAPPHIRE_RAPIDS, ZEN4])
def test_a_model_on_the_integer_kernels_keeps_float32_activations(flags, caplog):
    with caplog.at_level(logging.INFO, logger="kvserve.device"):
        assert resolve_dtype("auto", "cpu", flags, quantized=True) == torch.float32
    assert "integer kernels" in caplog.text
    assert resolve_dtype("bfloat16", "cpu", flags, quantized=True) == torch.bfloat16  # asked for: kept
    assert resolve_dtype("auto", "cuda", flags, quantized=True) == torch.bfloat16


def test_the_amx_gemm_needs_amx_and_can_be_turned_off(monkeypatch):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    monkeypatch.delenv("KVSERVE_AMX", raising=False)
    assert amx_gemm_available(SAPPHIRE_RAPIDS)
    assert not any(amx_gemm_available(f) for f in (AMD_AVX2, ICE_LAKE, COOPER_LAKE, ZEN4))
    monkeypatch.setenv("KVSERVE_AMX", "0")
    assert not amx_gemm_available(SAPPHIRE_RAPIDS)


def test_deterministic_by_default_where_it_costs_nothing(monkeypatch):
    """--deterministic: auto (None) is on for a CPU without AMX, off where the bf16 AMX paths run and on
    CUDA; an explicit choice is kept, and the flag round-trips through the CLI."""
    import argparse

    import kvserve.device as device
    from kvserve.config import KVServeConfig

    monkeypatch.setattr(device, "amx_gemm_available", lambda flags=None: False)
    assert device.resolve_deterministic(None, "cpu") and not device.resolve_deterministic(None, "cuda")
    monkeypatch.setattr(device, "amx_gemm_available", lambda flags=None: True)
    assert not device.resolve_deterministic(None, "cpu") and device.resolve_deterministic(True, "cpu")
    assert not device.resolve_deterministic(False, "cpu")
    for argv, want in (([], None), (["--deterministic"], True), (["--no-deterministic"], False)):
        parser = argparse.ArgumentParser()
        KVServeConfig.add_cli_args(parser)
        cfg = KVServeConfig.from_cli_args(parser.parse_args(argv))
        assert cfg.model.deterministic is want
        assert cfg.to_cli_args() == argv
