"""Transfer cost of a prompt's KV per 1,000 tokens through each KV connector (docs/scale-out.md).

A receiver process pinned to one core (the decode replica's side) and a sender here pinned to the
other (the prefill replica's) move 1,024 tokens of blocks of the given size, as the engine's handoff
does: TCP, from the first ``send`` to the receiver seeing the transfer DONE (every block checked
and stored); Redis (``--kv-connector shared-tier``), from the first ``send`` to the receiver having
found every block in Redis and read it back (one MGET, checked), as a decode replica's restore does.
Prints the median of ``--repeats`` and every run as JSON.

Usage: python scripts/bench_kv_transfer.py [--redis-url redis://127.0.0.1:6379/0] [--bytes-per-token 46080]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

from kvserve.kv.connector import DONE, SharedTierConnector
from kvserve.kv.redis_tier import RedisTier
from kvserve.kv.tcp_connector import TCPConnector

FP = b"bench-kv-transfer"
TOKENS, BLOCK = 1024, 16


def blocks(rep: int, block_bytes: int) -> list[tuple[bytes, tuple[int, ...], bytes]]:
    return [(f"{rep:08d}-{i:08d}".encode().ljust(32, b"k"), tuple(range(i * BLOCK, (i + 1) * BLOCK)),
             os.urandom(block_bytes)) for i in range(TOKENS // BLOCK)]


def tcp_receiver(pipe, core: int) -> None:
    os.sched_setaffinity(0, {core})
    conn = TCPConnector(FP, port=0)
    pipe.send(conn.address)
    while (tid := pipe.recv()) is not None:
        while conn.state(tid) != DONE:
            time.sleep(0.0005)
        pipe.send(time.monotonic())
        conn.drop(tid)


def redis_receiver(pipe, core: int, url: str) -> None:
    os.sched_setaffinity(0, {core})
    tier = RedisTier(url, FP)
    pipe.send("ready")
    while (items := pipe.recv()) is not None:
        keys = [k for k, _ in items]
        while tier.count_present(keys) < len(keys):
            time.sleep(0.0005)
        payloads = tier.get_many(items)
        assert all(p is not None for p in payloads)
        pipe.send(time.monotonic())


def run_tcp(block_bytes: int, repeats: int) -> list[float]:
    here, there = mp.Pipe()
    p = mp.Process(target=tcp_receiver, args=(there, 1), daemon=True)
    p.start()
    dest = here.recv()
    conn, out = TCPConnector(FP), []
    for rep in range(repeats + 1):  # the first opens the connection: not counted
        bl, tid = blocks(rep, block_bytes), f"t{rep}"
        here.send(tid)
        t0 = time.monotonic()
        for key, tokens, payload in bl:
            conn.send(dest, tid, key, tokens, payload)
        conn.finish(dest, tid, len(bl))
        done = here.recv()
        if rep:
            out.append(done - t0)
    here.send(None)
    p.join()
    conn.close()
    return out


def run_redis(url: str, block_bytes: int, repeats: int) -> list[float]:
    here, there = mp.Pipe()
    p = mp.Process(target=redis_receiver, args=(there, 1, url), daemon=True)
    p.start()
    here.recv()
    tier = RedisTier(url, FP)
    conn, out = SharedTierConnector([tier]), []
    for rep in range(repeats + 1):
        bl = blocks(rep + int(time.time()), block_bytes)  # keys not in Redis yet
        here.send([(k, t) for k, t, _ in bl])
        t0 = time.monotonic()
        for key, tokens, payload in bl:
            conn.send("", "", key, tokens, payload)
        done = here.recv()
        if rep:
            out.append(done - t0)
    here.send(None)
    p.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes-per-token", type=int, default=2 * 30 * 3 * 64 * 4,
                    help="KV bytes per token (default: SmolLM2-135M's 30 layers x 3 KV heads x 64, float32)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--redis-url", default=None)
    a = ap.parse_args()
    os.sched_setaffinity(0, {0})
    block_bytes = a.bytes_per_token * BLOCK
    res = {"tokens": TOKENS, "bytes_per_token": a.bytes_per_token, "load_average": os.getloadavg()}
    res["tcp_s"] = run_tcp(block_bytes, a.repeats)
    if a.redis_url:
        res["redis_s"] = run_redis(a.redis_url, block_bytes, a.repeats)
    for name in ("tcp_s", "redis_s"):
        if name in res:
            med = statistics.median(res[name])
            mb = TOKENS * a.bytes_per_token / 1e6
            print(f"{name[:-2]}: {med * 1e3 * 1000 / TOKENS:.1f} ms per 1,000 tokens "
                  f"({mb:.1f} MB per {TOKENS} tokens, {mb / med:.0f} MB/s; median of {len(res[name])})")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
