"""Timing the model's linear layers and this machine's read bandwidth, for ``kvserve bench roofline``.

Owns the torch side of the roofline: each linear through the kernel the engine runs it on
(``make_linear``: the weight format, the AMX tile copy of a decoder layer), its weights cycled so
that they come from memory as in a decode step (``measure_gemms``), and a large tensor's read
bandwidth (``measure_bandwidth``). ``bench/roofline.py`` does the arithmetic on them.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Callable

from kvserve.bench.stats import median

if TYPE_CHECKING:
    from kvserve.bench.roofline import LinearShape

COLD_MIB = 256  # decoder-layer weight copies cycled in the GEMM timing: more than the LLC, like the real model


def _timed(fn: Callable[[], None], min_time_s: float, repeats: int) -> float:
    """Median over ``repeats`` of the mean seconds per call, each repeat calling ``fn`` for ``min_time_s``."""
    fn()  # warm-up: oneDNN compiles its kernel for this shape here
    out = []
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_time_s:
                break
        out.append(elapsed / n)
    return median(out)


def make_linear(weight: Any, bias: Any, fmt: str | None = None, decoder: bool = False) -> Callable[[Any], Any]:
    """The engine's kernel for this weight: QuantLinear in a quantized format, PackedLinear where
    packing is supported, else F.linear. A quantized ``decoder`` linear has the tile copy the model's
    decoder layers have on an AMX CPU."""
    import torch

    from kvserve.model.layers import PackedLinear, cpu_packing_supported

    if fmt is not None:
        from kvserve.model.quant import quantize
        from kvserve.model.quant_linear import QuantLinear

        return QuantLinear(quantize(weight.float(), fmt), bias, weight.dtype, tiles=decoder)
    if cpu_packing_supported(weight.dtype):
        return PackedLinear(weight, bias)
    return lambda x: torch.nn.functional.linear(x, weight, bias)


def held_bytes(kernel: Any, shape: LinearShape, dtype: Any) -> int:
    """Bytes of the weight a many-row input makes ``kernel`` read: a QuantLinear's bf16 copy (tile or
    oneDNN, on AMX CPUs), else its packed quantized weight; any other linear's in ``dtype``."""
    import torch

    from kvserve.model.quant_linear import QuantLinear

    if isinstance(kernel, QuantLinear):
        if kernel.tiles is not None or kernel.amx is not None:
            return 2 * shape.n * shape.k
        if kernel.packed is not None:
            return kernel.packed.numel()
    return shape.n * shape.k * torch.empty((), dtype=dtype).element_size()


def measure_gemms(shapes: list[LinearShape], layers: int, dtype: Any, rows: list[int], repeats: int,
                  min_time_s: float = 0.05, cold_mib: int = COLD_MIB,
                  formats: dict[str, str | None] | None = None) -> dict[int, dict[str, float]]:
    """Seconds per call of each linear at each row count. Decoder linears cycle through several
    layers' worth of distinct weights (up to ``cold_mib`` of what their kernels read, at most one per
    layer, ``layers`` of them), so a weight is not cache-hot on every call, as in a step."""
    import torch

    gen = torch.Generator().manual_seed(0)
    kernels: dict[str, list[Callable[[Any], Any]]] = {}
    with torch.inference_mode():
        def build(s: LinearShape) -> Callable[[Any], Any]:
            return make_linear(torch.randn(s.n, s.k, generator=gen).mul_(0.02).to(dtype),
                               torch.zeros(s.n, dtype=dtype) if s.bias else None, (formats or {}).get(s.name),
                               decoder=s.count > 1)

        for s in shapes:
            kernels[s.name] = [build(s)]
        # as many layers' worth of copies as fill cold_mib, in the bytes the kernels read
        layer_bytes = sum(held_bytes(kernels[s.name][0], s, dtype) for s in shapes if s.count > 1)
        copies = max(1, min(layers, math.ceil(cold_mib * 2**20 / max(layer_bytes, 1))))
        for s in shapes:
            if s.count > 1:
                kernels[s.name] += [build(s) for _ in range(copies - 1)]
        result: dict[int, dict[str, float]] = {}
        for m in rows:
            result[m] = {}
            for s in shapes:
                x = torch.randn(m, s.k, generator=gen).to(dtype)
                ks = kernels[s.name]

                def run(ks: list = ks, x: Any = x) -> None:
                    for k in ks:
                        k(x)

                result[m][s.name] = _timed(run, min_time_s, repeats) / len(ks)
    return result


def measure_bandwidth(mib: int, repeats: int) -> tuple[float, str]:
    """Read bandwidth in GB/s and how it was read: ``mib`` MiB streamed by the native kernels' reader
    (``ops.read_stream``: the way the decode GEMVs read their weights), or summed by torch where the
    kernels are not loaded (a plain read: lower on CPUs where a far prefetch pays). Median of ``repeats``."""
    import torch

    from kvserve.kernels import ops

    read: Callable[[], object]
    if ops.available():  # on the pages the packed weights get
        buf = ops.zeros_huge(mib * 2**20)
        read, how = (lambda: ops.read_stream(buf)), "streamed"
    else:
        t = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
        read, how = t.sum, "float32 summed"
    read()  # warm-up: pages touched, threads started
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        read()
        times.append(time.perf_counter() - t0)
    return mib * 2**20 / median(times) / 1e9, how
