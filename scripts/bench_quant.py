"""GEMM times of the quantized kernels vs oneDNN float32 at the embedded model's shapes.

For each weight shape and M rows: the median ms of oneDNN's packed float32 GEMM (what
``PackedLinear`` runs), the Q8_0 kernel and the Q4_1 kernel; with ``--bf16``, also the Q4_1 weight
dequantized to bf16 in the call and multiplied by oneDNN in bf16 (no copy held: a prefill's
alternative on AVX512-BF16 CPUs). One thread by default: on a shared machine a second thread that
loses its core stalls every call. ``--shapes olmoe``: OLMoE-1B-7B's expert and attention shapes.

    python scripts/bench_quant.py [--threads 1] [--rows 1 8 64] [--shapes smollm2|olmoe] [--bf16]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.kernels import load_kernels
from kvserve.model.quant import quantize

SHAPE_SETS = {
    "smollm2": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)},
    "olmoe": {"qkv": (6144, 2048), "o": (2048, 2048), "expert_gate_up": (2048, 2048), "expert_down": (2048, 1024)},
}


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
    ap.add_argument("--shapes", choices=sorted(SHAPE_SETS), default="smollm2")
    ap.add_argument("--bf16", action="store_true", help="also time dequantize-to-bf16 + oneDNN bf16 (Q4_1)")
    args = ap.parse_args()
    if not load_kernels():
        raise SystemExit("the native kernels did not build")
    torch.set_num_threads(args.threads)
    ops = torch.ops.kvserve
    print(f"{'shape':>14} {'N x K':>11} {'M':>4} {'fp32 ms':>8} {'q8_0 ms':>8} {'q4_1 ms':>8} {'fp32/q8':>7} {'fp32/q4':>7}"
          + (f" {'bf16 ms':>8} {'q4/bf16':>7}" if args.bf16 else ""))
    for name, (n, k) in SHAPE_SETS[args.shapes].items():
        w = torch.randn(n, k)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        q8, q4 = (ops.pack_quant(q.qs, q.d, q.m) for q in (quantize(w, "q8_0"), quantize(w, "q4_1")))
        for m in args.rows:
            x = torch.randn(m, k)
            reps = 9 if n * m > 1 << 20 else 41
            f = median_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), reps)
            a = median_ms(lambda: ops.packed_linear(x, q8, "q8_0", n), reps)
            b = median_ms(lambda: ops.packed_linear(x, q4, "q4_1", n), reps)
            row = f"{name:>14} {n:>5}x{k:<5} {m:>4} {f:8.3f} {a:8.3f} {b:8.3f} {f / a:7.2f} {f / b:7.2f}"
            if args.bf16:
                c = median_ms(lambda: torch.nn.functional.linear(
                    x.bfloat16(), ops.dequantize_packed(q4, "q4_1", n, k).bfloat16()).float(), reps)
                row += f" {c:8.3f} {b / c:7.2f}"
            print(row)


if __name__ == "__main__":
    main()
