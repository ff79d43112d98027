"""Which device and dtype a run uses: ``--device auto`` and ``--dtype auto`` resolved, and why.

``auto`` picks bfloat16 only where matmuls run natively in it: on CUDA, and on CPUs whose flags
show AVX512-BF16 or AMX-BF16. Elsewhere oneDNN emulates bf16 (it reports bf16 "supported" on any
AVX512 CPU), and a bf16 GEMM is several times slower than float32 (measured 7x on both this
project's AVX2 machines and an AVX512 Ice Lake without AVX512-BF16), so ``auto`` is float32.
A model whose linear layers run on kvserve's integer kernels (the embedded GGUF model's default)
keeps float32 activations on every CPU: its GEMMs do not run in the model's dtype, and in bf16 a
decode step falls back from the whole-step native call to the Python layers (2.8x slower a 64-row
step on a Sapphire Rapids-class Xeon, docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import os

import torch

from kvserve.kernels.isa import effective_flags as cpu_flags  # KVSERVE_CPU_ISA's view
from kvserve.errors import InvalidArgumentError

log = logging.getLogger(__name__)

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo names of native bf16 instructions




def native_bf16_flags(flags: set[str]) -> list[str]:
    """The native bf16 instruction sets among ``flags``."""
    return [f for f in NATIVE_BF16_FLAGS if f in flags]


def amx_gemm_available(flags: set[str] | None = None) -> bool:
    """Whether quantized linears should take oneDNN's bf16 GEMM for many-row inputs: a CPU with
    AMX-BF16 (``kvserve.model.quant_linear``), oneDNN in torch, and KVSERVE_AMX not 0."""
    if os.environ.get("KVSERVE_AMX", "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    return "amx_bf16" in (cpu_flags() if flags is None else flags)


def resolve_deterministic(deterministic: bool | None, device: str) -> bool:
    """``--deterministic`` (None: auto): on a CPU, auto is on unless the CPU runs the bf16 AMX paths, whose
    results depend on a step's row count (docs/determinism.md); on CUDA auto is off (no invariant kernels)."""
    if deterministic is not None:
        return deterministic
    return not device.startswith("cuda") and not amx_gemm_available()


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidArgumentError("--device cuda was asked for, but torch sees no CUDA device", param="device")
    return device


def resolve_dtype(dtype: str, device: str, flags: set[str] | None = None, quantized: bool = False) -> torch.dtype:
    """The torch dtype of ``--dtype`` on ``device``; ``auto`` is decided (and logged) as the module says.
    ``flags``: the CPU's flags (default: this machine's); ``quantized``: the linear layers run on
    kvserve's integer kernels."""
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.startswith("cuda"):
        log.info("dtype auto: bfloat16 (CUDA)")
        return torch.bfloat16
    if quantized:
        log.info("dtype auto: float32 (the linear layers run on the integer kernels, which quantize their inputs "
                 "themselves, and a decode step runs as one native call only in float32)")
        return torch.float32
    native = native_bf16_flags(cpu_flags() if flags is None else flags)
    if native:
        log.info("dtype auto: bfloat16 (this CPU has native bf16: %s)", ", ".join(native))
        return torch.bfloat16
    log.info("dtype auto: float32 (this CPU has no AVX512-BF16 or AMX: bf16 would be emulated, ~7x slower; "
             "--dtype bfloat16 forces it)")
    return torch.float32
