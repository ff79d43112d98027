"""TTFT of a long prompt on a second replica: recompute, or restore the first replica's KV from a
shared Redis tier or a shared disk directory; and what the blocks cost Redis in memory.

Starts its own redis-server (Debian's) on a free 127.0.0.1 port and makes a temporary directory
(``--dir`` to put it elsewhere, e.g. on an NFS mount). Replica A computes each prompt with both
shared tiers on (``--kv-offload-url`` and ``--kv-offload-dir`` with ``--kv-offload-dir-shared``),
so its blocks land in both as they are computed. Then each second replica is a fresh engine
process of its own (this script run with ``--replica MODE``) that serves the same prompts:
``recompute`` (no tiers), ``redis`` (the Redis tier only), ``disk`` (the directory only, its files
in the page cache as A left them) and ``disk-cold`` (the same, each prompt's files first dropped
from the page cache with posix_fadvise DONTNEED, so they are read from the device).
Offline engines (kvserve.LLM) on the embedded model, one prompt at a time, max_tokens 1: the time
of the call is the TTFT without a server.

    python scripts/bench_kv_tiers.py [--prompt-len 4000] [--prompts 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("recompute", "redis", "disk", "disk-cold")


def prompts_of(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]


def tier_kwargs(mode: str, url: str, directory: str) -> dict:
    if mode == "redis":
        return {"kv_offload_url": url}
    if mode.startswith("disk"):
        return {"kv_offload_dir": directory, "kv_offload_dir_shared": True}
    return {}


def drop_from_page_cache(directory: str) -> None:
    for f in Path(directory).glob("*.kvb"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def replica(args: argparse.Namespace) -> None:
    """A second replica in a process of its own: time each prompt, print the results as JSON."""
    from kvserve import LLM, SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0)
    llm = LLM(**tier_kwargs(args.replica, args.url, args.dir))
    llm.generate([[7, 8, 9]], one)  # warm up
    times, outputs, cached = [], [], []
    for p in prompts_of(args):
        if args.replica == "disk-cold":
            drop_from_page_cache(args.dir)
        t0 = time.perf_counter()
        out = llm.generate([p], one)[0]
        times.append(time.perf_counter() - t0)
        outputs.append(out.token_ids)
        cached.append(out.num_cached_tokens)
    print(json.dumps({"times": times, "outputs": outputs, "cached": cached, "tier_hits": llm.engine.kv.stats.tier_hits}))


def start_redis() -> tuple[subprocess.Popen, int]:
    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--maxmemory", "4gb", "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.02)
    return proc, port


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=4000)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--dir", help="the shared disk directory (default: a temporary one, deleted after)")
    ap.add_argument("--json")
    ap.add_argument("--replica", choices=MODES, help=argparse.SUPPRESS)  # internal: run one second replica
    ap.add_argument("--url", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.replica:
        replica(args)
        return
    if shutil.which("redis-server") is None:
        raise SystemExit("bench_kv_tiers: redis-server is not installed (apt-get install redis-server)")
    import redis

    from kvserve import LLM, SamplingParams
    from kvserve.kv.redis_tier import RedisTier

    proc, port = start_redis()
    own_dir = args.dir is None
    directory = args.dir or tempfile.mkdtemp(prefix="kvserve-bench-tiers-")
    try:
        client = redis.Redis(port=port)
        url = f"redis://127.0.0.1:{port}/0"
        one = SamplingParams(max_tokens=1, temperature=0.0)
        prompts = prompts_of(args)
        a = LLM(kv_offload_url=url, kv_offload_dir=directory, kv_offload_dir_shared=True)
        if args.prompt_len >= a.engine.max_model_len:
            raise SystemExit(f"bench_kv_tiers: --prompt-len must be below the model's context window "
                             f"({a.engine.max_model_len} tokens)")
        base_memory = int(client.info("memory")["used_memory"])
        for p in prompts:
            a.generate([p], one)
        tier = next(t for t in a.engine.kv.tiers.tiers if isinstance(t, RedisTier))
        tier.flush(600)
        used = int(client.info("memory")["used_memory"]) - base_memory
        cached_tokens = tier.written * a.engine.kv.block_size
        disk_bytes = sum(f.stat().st_size for f in Path(directory).glob("*.kvb"))
        del a
        runs = {}
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--replica", mode, "--url", url, "--dir", directory,
                                  "--prompt-len", str(args.prompt_len), "--prompts", str(args.prompts)],
                                 capture_output=True, text=True, check=True)
            runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
            if mode != "recompute":
                assert min(runs[mode]["cached"]) >= args.prompt_len - 16, (mode, runs[mode]["cached"])
        # the restored KV is the first replica's, bit for bit; the prompt's last block is computed in a
        # 16-row step instead of inside a 2,048-row chunk, so in float32 a near-tie may break otherwise
        agree = {m: sum(r["outputs"][i] == runs["recompute"]["outputs"][i] for i in range(args.prompts))
                 for m, r in runs.items() if m != "recompute"}
        result = {"prompt_len": args.prompt_len, "prompts": args.prompts,
                  "median_s": {m: statistics.median(r["times"]) for m, r in runs.items()},
                  "samples_s": {m: r["times"] for m, r in runs.items()},
                  "tier_hits": {m: r["tier_hits"] for m, r in runs.items()},
                  "same_first_token_as_recompute": {m: f"{n}/{args.prompts}" for m, n in agree.items()},
                  "redis_bytes": used, "cached_tokens": cached_tokens, "disk_bytes": disk_bytes,
                  "redis_bytes_per_1000_tokens": used / cached_tokens * 1000,
                  "disk_bytes_per_1000_tokens": disk_bytes / cached_tokens * 1000}
        for m, v in result["median_s"].items():
            print(f"{m:>10}: TTFT {v * 1000:.0f} ms (median of {args.prompts})")
        print(f"same first token as a recompute: {agree}")
        print(f"Redis memory: {used / 1e6:.1f} MB for {cached_tokens} tokens = "
              f"{result['redis_bytes_per_1000_tokens'] / 1e6:.1f} MB per 1,000 tokens; disk "
              f"{result['disk_bytes_per_1000_tokens'] / 1e6:.1f} MB per 1,000 tokens")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    finally:
        proc.terminate()
        proc.wait(10)
        if own_dir:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
