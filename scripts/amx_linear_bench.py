"""The decoder linears of the embedded model on AMX: kvserve's tile kernel (amx_linear) against
oneDNN's bf16 GEMM (PackedLinear), per call, at a few row counts.

"cold": the call cycles through copies of the weight filling ~384 MiB, so they come from memory as
in a decode step (whose K/V evicts them); "warm": one weight, called again and again. Medians of 7.
Usage: .venv/bin/python scripts/amx_linear_bench.py [rows ...]   (default 16 64 256 512 2048; cold at <= 256)
"""

import statistics
import sys
import time

import torch

from kvserve.kernels import load_kernels
from kvserve.model.layers import PackedLinear

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def per_call_us(fn, calls: int, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / calls * 1e6


def main() -> None:
    if not (load_kernels() and torch.ops.kvserve.amx_gemm_available()):
        sys.exit("amx_linear_bench: this CPU (or build) has no AMX tiles")
    rows = [int(r) for r in sys.argv[1:]] or [16, 64, 256, 512, 2048]
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            copies = max(2, (384 << 20) // (n * k * 2))
            weights = [(torch.randn(n, k, generator=gen) * 0.02).bfloat16() for _ in range(copies)]
            tiles = [torch.ops.kvserve.amx_pack(w) for w in weights]
            onednn = [PackedLinear(w, None) for w in weights]
            for m in rows:
                x = torch.randn(m, k, generator=gen).bfloat16()
                warm = (per_call_us(lambda: torch.ops.kvserve.amx_linear(x, tiles[0], n), 1),
                        per_call_us(lambda: onednn[0](x), 1))
                line = f"{name:8s} {m:5d} rows  warm: tiles {warm[0]:7.0f} us, oneDNN {warm[1]:7.0f} us"
                if m <= 256:
                    cold = (per_call_us(lambda: [torch.ops.kvserve.amx_linear(x, t, n) for t in tiles], copies),
                            per_call_us(lambda: [lin(x) for lin in onednn], copies))
                    line += (f"   cold: tiles {cold[0]:7.0f} us ({n * k * 2 / cold[0] / 1e3:4.1f} GB/s), "
                             f"oneDNN {cold[1]:7.0f} us ({n * k * 2 / cold[1] / 1e3:4.1f} GB/s)")
                print(line, flush=True)
            del weights, tiles, onednn


if __name__ == "__main__":
    main()
