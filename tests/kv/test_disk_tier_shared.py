"""The disk tier's directory shared by several processes (replicas, restarts): concurrent writers and
readers never read a wrong block, the size cap holds across them, and torn or foreign files are misses."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import time
from pathlib import Path

from kvserve.kv.disk_tier import LOCK_NAME, DiskTier
from kvserve.kv.tiers import encode_entry

FP = b"fingerprint-a"
NUM_KEYS = 48
PAYLOAD = 4096
WRITERS = 3


def block(i: int) -> tuple[bytes, tuple[int, ...], bytes]:
    """Key, tokens and payload of block ``i``: every process derives the same ones."""
    key = hashlib.sha256(b"key%d" % i).digest()[:16]
    payload = b"".join(hashlib.sha256(b"%d:%d" % (i, j)).digest() for j in range(PAYLOAD // 32))
    return key, (i, i + 1, i + 2, i + 3), payload


ENTRY = len(encode_entry(FP, block(0)[1], block(0)[2]))  # bytes of one entry on disk
CAP = 12 * ENTRY  # a quarter of the keys fit: writers keep evicting each other's blocks


def hammer(directory: str, seed: int, seconds: float, results) -> None:
    """One replica: random reads and writes of the shared blocks; every hit's bytes are checked."""
    tier = DiskTier(directory, CAP, FP)
    rng = random.Random(seed)
    hits = wrong = puts = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        key, tokens, payload = block(rng.randrange(NUM_KEYS))
        if rng.random() < 0.5:
            got = tier.get(key, tokens)
            if got is not None:
                hits += 1
                wrong += got != payload
        else:
            tier.put(key, tokens, payload)
            puts += 1
    results.put((hits, wrong, puts, tier.enabled))


def dir_bytes(directory: Path) -> int:
    total = 0
    for f in directory.iterdir():
        if f.name != LOCK_NAME:
            try:
                total += f.stat().st_size
            except FileNotFoundError:
                pass
    return total


def test_processes_sharing_a_directory_read_only_whole_blocks_within_the_cap(tmp_path: Path):
    ctx = mp.get_context("fork")  # the workers use the tier only (no torch)
    results = ctx.Queue()
    procs = [ctx.Process(target=hammer, args=(str(tmp_path), seed, 3.0, results)) for seed in range(WRITERS)]
    for p in procs:
        p.start()
    # Sample the directory while they run, holding the tier's lock (entries change only under it;
    # each writer may have one temporary file in flight besides).
    lock_fd = None
    peak = samples = 0
    while any(p.is_alive() for p in procs):
        if lock_fd is None and (tmp_path / LOCK_NAME).exists():
            lock_fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR)
        if lock_fd is not None:
            import fcntl

            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            try:
                peak = max(peak, dir_bytes(tmp_path))
                samples += 1
            finally:
                fcntl.flock(lock_fd, fcntl.LOCK_UN)
        time.sleep(0.01)
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    stats = [results.get(timeout=5) for _ in procs]
    assert all(enabled for *_, enabled in stats)
    assert sum(h for h, *_ in stats) > 50 and sum(p for _, _, p, _ in stats) > 50  # they did share the work
    assert sum(w for _, w, *_ in stats) == 0  # no hit ever returned other bytes than the block's
    assert samples > 20 and peak <= CAP + WRITERS * ENTRY
    final = dir_bytes(tmp_path)
    assert final <= CAP
    assert not list(tmp_path.glob(".*.tmp"))
    # the shared count the writers kept is the directory's true size
    assert int.from_bytes((tmp_path / LOCK_NAME).read_bytes()[:8], "little") == final


def test_truncated_and_foreign_files_are_misses(tmp_path: Path, caplog):
    tier = DiskTier(tmp_path, 1 << 20, FP)
    key, tokens, payload = block(1)
    tier.put(key, tokens, payload)
    path = tmp_path / f"{key.hex()}.kvb"
    assert tier.get(key, tokens) == payload

    # a torn write (a crash before the data reached the disk): a miss, and the entry is deleted
    path.write_bytes(path.read_bytes()[: ENTRY // 2])
    assert key in tier and tier.get(key, tokens) is None and not path.exists()
    assert tier.stats.corrupt == 1

    # a file of another model or KV layout under the same name: a miss, never its bytes
    path.write_bytes(encode_entry(b"fingerprint-b", tokens, payload))
    assert tier.get(key, tokens) is None and tier.stats.corrupt == 2
    # and one cut short inside its header
    path.write_bytes(encode_entry(FP, tokens, payload)[:7])
    assert tier.get(key, tokens) is None

    # the tier writes the block again, and reads it whole
    tier.put(key, tokens, payload)
    assert tier.get(key, tokens) == payload


def test_a_read_keeps_an_entry_and_the_cap_evicts_the_least_recently_used(tmp_path: Path):
    """Two tiers (two replicas) on one directory: what one reads, the other's writes do not evict first."""
    a, b = DiskTier(tmp_path, 3 * ENTRY + ENTRY // 2, FP), DiskTier(tmp_path, 3 * ENTRY + ENTRY // 2, FP)
    for i in range(3):
        a.put(*block(i))
        past = time.time() - 100 + i  # distinct, old mtimes: block 0 the oldest
        os.utime(tmp_path / f"{block(i)[0].hex()}.kvb", (past, past))
    assert b.get(block(0)[0], block(0)[1]) == block(0)[2]  # b reads block 0: now the newest
    b.put(*block(3))  # over the cap: the least recently used go, block 0 stays
    assert block(0)[0] in a and block(3)[0] in a and block(1)[0] not in a
    assert dir_bytes(tmp_path) <= 3 * ENTRY + ENTRY // 2


def test_a_second_replica_restores_what_the_first_computed(tmp_path: Path):
    """With --kv-offload-dir-shared, blocks land in the directory as soon as they are computed (no eviction
    needed): a second engine on the same directory restores the prompt and answers the same."""
    from conftest import hf_weights, kvserve_config, tiny_hf_model
    from kvserve import SamplingParams
    from kvserve.llm import LLM

    hf = tiny_hf_model(kv_heads=2)
    cfg, w = kvserve_config(hf), hf_weights(hf)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [random.Random(3).randrange(3, 97) for _ in range(37)]

    def replica(**kw):
        return LLM.from_weights(cfg, w, dtype="float32", num_kv_blocks=64, block_size=4, **kw)

    want = replica().generate([prompt], greedy)[0].token_ids
    first = replica(kv_offload_dir=str(tmp_path), kv_offload_dir_shared=True)
    assert first.generate([prompt], greedy)[0].token_ids == want
    assert len(list(tmp_path.glob("*.kvb"))) >= 9  # the prompt's 9 full blocks, nothing evicted
    second = replica(kv_offload_dir=str(tmp_path), kv_offload_dir_shared=True)
    out = second.generate([prompt], greedy)[0]
    assert out.token_ids == want and out.num_cached_tokens == 36
    assert second.engine.kv.stats.tier_hits["disk"] == 36
