"""One layer's attention, gather-sdpa against paged, at the embedded model's shape (9 heads, 3 KV
heads, head_dim 64, block 16): per case, the median of interleaved runs of build_metadata and of
forward (KV write + attention), in milliseconds.

    python scripts/bench_attention.py [--dtype float32] [--runs 15] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvserve.attention import KVPool, SeqRows
from kvserve.attention.paged import PagedBackend
from kvserve.attention.sdpa import GatherSdpaBackend
from kvserve.kernels import load_kernels
from kvserve.kv.layout import KVLayout

HEADS, KV_HEADS, D, BS = 9, 3, 64, 16


def case(rows: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0):
    """rows: (tokens, start) per sequence; decodes (1 token, start > 0) first, sorted by context."""
    rng = random.Random(seed)
    need = sum(-(-(n + s) // BS) for n, s in rows)
    pool = KVPool(KVLayout(1, KV_HEADS, D, BS, str(dtype).removeprefix("torch.")), need + 8, torch.device("cpu"))
    for t in pool.layers[0]:
        t.normal_()
    free = list(range(need + 8))
    rng.shuffle(free)
    seqs = [SeqRows([1] * n, s, [free.pop() for _ in range(-(-(n + s) // BS))]) for n, s in rows]
    t = sum(n for n, _ in rows)
    q, k, v = (torch.randn(t, h, D).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
    nd = sum(1 for n, s in rows if n == 1 and s > 0)
    return pool, seqs, nd, q, k, v


def timed(fn, runs: int) -> float:
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


@torch.inference_mode()
def bench(name: str, rows: list[tuple[int, int]], dtype: torch.dtype, runs: int) -> None:
    pool, seqs, nd, q, k, v = case(rows, dtype)
    variants = {"gather-sdpa": GatherSdpaBackend(pool, dtype), "paged": PagedBackend(pool, dtype)}
    if any(s.start == 0 and len(s.tokens) > 1 for s in seqs):
        kernel_all = PagedBackend(pool, dtype)
        kernel_all.fresh_prefill_sdpa = False
        variants["paged (kernel for fresh)"] = kernel_all
    res: dict[str, list[tuple[float, float]]] = {n: [] for n in variants}
    for _ in range(runs):  # interleaved, so drift and the other load hit every variant alike
        for n, b in variants.items():
            meta_ms = timed(lambda: b.build_metadata(seqs, nd), 1)
            meta = b.build_metadata(seqs, nd)
            fwd_ms = timed(lambda: b.forward(q, k, v, pool.layers[0], meta), 1)
            res[n].append((meta_ms, fwd_ms))
    base = statistics.median(f for _, f in res["gather-sdpa"])
    for n, r in res.items():
        meta_ms, fwd_ms = statistics.median(m for m, _ in r), statistics.median(f for _, f in r)
        print(f"{name:34s} {n:26s} metadata {meta_ms:7.3f} ms  forward {fwd_ms:8.3f} ms  ({base / fwd_ms:4.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    assert load_kernels(), "the native kernels did not build"
    print(f"threads {torch.get_num_threads()}, simd {torch.ops.kvserve.simd_level()}, {args.dtype}")
    rng = random.Random(1)
    bench("64 decodes, context 128-512", sorted((1, rng.randrange(128, 512)) for _ in range(64)), dtype, args.runs)
    bench("8 decodes, context ~2k", sorted((1, rng.randrange(1900, 2100)) for _ in range(8)), dtype, args.runs)
    bench("1 decode at 4k + 63 at ~200", sorted([(1, 4000)] + [(1, rng.randrange(150, 250)) for _ in range(63)],
                                                 key=lambda r: r[1]), dtype, args.runs)
    bench("chunk 256 after 1024 cached", [(256, 1024)], dtype, args.runs)
    bench("16 decodes@300 + chunk 128@512", [(1, 300)] * 16 + [(128, 512)], dtype, args.runs)
    bench("fresh prefill 2048", [(2048, 0)], dtype, max(3, args.runs // 3))
    bench("fresh prefill 512", [(512, 0)], dtype, args.runs)
    bench("fresh prefill 64", [(64, 0)], dtype, args.runs)


if __name__ == "__main__":
    main()
