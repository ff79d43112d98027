"""The LM head and the draw on an AMX CPU: amx_head_sample (one pass, no logits written) against
oneDNN's bf16 head writing bf16 logits and the sampler's native argmax / draw, greedy and sampled
(T = 1), for the embedded model's head shape (49,152 x 576).

Cold: six copies of the weight cycled (~340 MB of bf16 and oneDNN copies), as a decode step finds the
head after streaming the layers' weights and K/V; warm: one copy, called again and again.
Results: docs/benchmarks.md, session 23.

    .venv/bin/python scripts/amx_head_bench.py [--rows 16 64 128] [--reps 8]
"""

from __future__ import annotations

import argparse
import time
from statistics import median

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--reps", type=int, default=8)
    a = ap.parse_args()
    from kvserve.kernels import load_kernels
    from kvserve.model.layers import PackedLinear

    if not load_kernels() or not torch.ops.kvserve.amx_gemm_available():
        raise SystemExit("amx_head_bench: needs the native kernels on a CPU with AMX-BF16")
    ops = torch.ops.kvserve
    n, k = 49152, 576
    copies = []
    for _ in range(6):
        w = (torch.randn(n, k) * 0.05).bfloat16()
        copies.append((ops.amx_pack(w), PackedLinear(w, None)))
    for m in a.rows:
        x = torch.randn(m, k).bfloat16()
        for mode in ("greedy", "sampled"):
            inv_t = torch.zeros(m) if mode == "greedy" else torch.ones(m)
            u = torch.rand(m)

            def fused(c):
                ops.amx_head_sample(x, c[0], n, inv_t, u)

            def unfused(c):
                logits = c[1](x, dtype=torch.bfloat16)
                ops.argmax_rows(logits) if mode == "greedy" else ops.sample_rows(logits, inv_t, u)

            for name, fn in (("amx_head_sample", fused), ("oneDNN head + draw", unfused)):
                cold, warm = [], []
                for _ in range(a.reps):
                    for c in copies:
                        t = time.perf_counter()
                        fn(c)
                        cold.append(time.perf_counter() - t)
                    for _ in range(6):
                        t = time.perf_counter()
                        fn(copies[0])
                        warm.append(time.perf_counter() - t)
                print(f"rows {m:4d} {mode:8s} {name:20s} cold {1e3 * median(cold):6.2f} ms   warm {1e3 * median(warm):6.2f} ms")


if __name__ == "__main__":
    main()
