"""What one summary of the prefix tree costs the engine (kvserve/kv/prefix_view.py, the live view's walk).

    python scripts/bench_prefix_view.py [--prompts 1500 --blocks 20 --max-nodes 10000]

Builds a radix tree like a busy chat server's (every prompt starts with 1 to 5 blocks of one shared
system prompt, then its own blocks) and times ``summarize`` on it: the median of 7 runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.prefix_view import MAX_NODES, summarize
from kvserve.kv.radix_cache import RadixCache

BS = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=1500)
    ap.add_argument("--blocks", type=int, default=20, help="blocks per prompt")
    ap.add_argument("--max-nodes", type=int, default=MAX_NODES)
    args = ap.parse_args()
    rng = random.Random(0)
    pool = BlockPool(args.prompts * args.blocks + 1, BS)
    cache = RadixCache(pool)
    shared = [rng.randrange(50_000) for _ in range(5 * BS)]
    for _ in range(args.prompts):
        head = shared[: BS * rng.randrange(1, 6)]
        prompt = head + [rng.randrange(50_000) for _ in range(BS * args.blocks - len(head))]
        cache.match(prompt)
        blocks = pool.allocate(len(prompt) // BS)
        cache.insert(prompt, blocks)
        pool.release(blocks)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        view = summarize(cache, max_nodes=args.max_nodes)
        times.append(time.perf_counter() - start)
    print(f"{cache.num_nodes} nodes, walk capped at {args.max_nodes} (complete: {view.complete}): "
          f"summarize median {statistics.median(times) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
