"""GEMM times of the quantized kernels vs oneDNN float32 at the embedded model's shapes.

For each weight shape and M rows: the median ms of oneDNN's packed float32 GEMM (what
``PackedLinear`` runs), the Q8_0 kernel and the Q4_1 kernel. One thread by default: on a shared
machine a second thread that loses its core stalls every call.

    python scripts/bench_quant.py [--threads 1] [--rows 1 8 64]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.kernels import load_kernels
from kvserve.model.quant import quantize

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    args = ap.parse_args()
    if not load_kernels():
        raise SystemExit("the native kernels did not build")
    torch.set_num_threads(args.threads)
    ops = torch.ops.kvserve
    print(f"{'shape':>8} {'N x K':>11} {'M':>4} {'fp32 ms':>8} {'q8_0 ms':>8} {'q4_1 ms':>8} {'fp32/q8':>7} {'fp32/q4':>7}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        q8, q4 = (ops.pack_quant(q.qs, q.d, q.m) for q in (quantize(w, "q8_0"), quantize(w, "q4_1")))
        for m in args.rows:
            x = torch.randn(m, k)
            reps = 9 if n * m > 1 << 20 else 41
            f = median_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), reps)
            a = median_ms(lambda: ops.packed_linear(x, q8, "q8_0", n), reps)
            b = median_ms(lambda: ops.packed_linear(x, q4, "q4_1", n), reps)
            print(f"{name:>8} {n:>5}x{k:<5} {m:>4} {f:8.3f} {a:8.3f} {b:8.3f} {f / a:7.2f} {f / b:7.2f}")


if __name__ == "__main__":
    main()
