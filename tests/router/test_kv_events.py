"""KV events: the prefix cache reports what it stores and drops, the server numbers them, and
``GET /kv/events`` serves them so that a router's mirror of the cache is exact.

The unit tests drive the cache and the log directly; the last test runs a replica of the tiny
random model with a small KV pool and checks its route against the hashes the router computes.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from kvserve.config import KVServeConfig, ServerConfig
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.events import CacheEvents
from kvserve.kv.manager import KVManager
from kvserve.kv.radix_cache import RadixCache
from kvserve.router.backends import Backend
from kvserve.router.prefix import HashScheme, block_hashes
from kvserve.server.engine_client import AsyncEngineClient
from kvserve.server.kv_events import KVEventLog
from server_utils import ServerThread

ROOT = b"fingerprint"


def test_cache_events_keep_only_net_changes():
    ev = CacheEvents()
    ev.stored(b"a")
    ev.stored(b"b")
    ev.removed(b"b")  # stored and dropped within one message: never news
    ev.removed(b"c")
    ev.removed(b"d")
    ev.stored(b"d")  # dropped and stored again: still cached
    assert ev.take() == ([b"a"], [b"c"])
    assert not ev and ev.take() == ([], [])


def test_radix_cache_reports_stores_and_evictions_under_the_routers_names():
    pool = BlockPool(8, 2)
    cache = RadixCache(pool, ROOT)
    cache.events = CacheEvents()
    scheme = HashScheme(ROOT, 2)
    a, b = pool.allocate(3), pool.allocate(2)
    cache.insert([1, 2, 3, 4, 5, 6], a)
    cache.insert([1, 2, 7, 8], b)  # shares the first block
    stored, removed = cache.events.take()
    # a prompt's blocks, as the router names them (all but the last token are matched)
    want = set(block_hashes([1, 2, 3, 4, 5, 6, 0], scheme)) | set(block_hashes([1, 2, 7, 8, 0], scheme))
    assert set(stored) == want and len(stored) == 4 and removed == []
    assert set(cache.keys()) == want
    pool.release(a)
    pool.release(b)
    cache.evict(8)  # everything the tree holds alone
    stored, removed = cache.events.take()
    assert stored == [] and set(removed) == want
    assert cache.keys() == []


def test_radix_cache_eviction_lists_each_dropped_node():
    pool = BlockPool(8, 2)
    cache = RadixCache(pool, ROOT)
    cache.events = CacheEvents()
    a = pool.allocate(3)
    cache.insert([1, 2, 3, 4, 5, 6], a)
    stored, _ = cache.events.take()
    pool.release(a)
    pool.share(a[2])  # a request still holds the last block: dropping its parent drops it from the tree too
    cache.evict(1)
    stored_after, removed = cache.events.take()
    assert stored_after == [] and set(removed) <= set(stored) and removed
    cache.evict(8)
    _, removed_more = cache.events.take()
    assert set(removed) | set(removed_more) == set(stored)


def test_kv_manager_records_only_when_asked():
    kv = KVManager(8, 2, fingerprint=ROOT)
    kv.grow("s", 4)
    kv.cache_blocks("s", [1, 2, 3, 4], 4)
    assert kv.take_events() == ([], [])
    kv.record_events()
    kv.grow("t", 4)
    kv.cache_blocks("t", [5, 6, 7, 8], 4)
    stored, removed = kv.take_events()
    assert stored == block_hashes([5, 6, 7, 8, 0], HashScheme(kv.cache_root_key, 2)) and removed == []
    assert KVManager(8, 2, enable_prefix_caching=False).take_events() == ([], [])


def test_event_log_since_merges_and_resets():
    log = KVEventLog(16, ROOT, max_hashes=4)
    log.apply([b"a", b"b"], [])
    log.apply([b"c"], [b"a"])
    assert log.seq == 2 and log.cached == {b"b", b"c"}
    got = log.since(0, log.epoch)
    assert not got.reset and set(got.stored) == {b"b", b"c"} and got.removed == []  # a came and went
    got = log.since(1)
    assert not got.reset and got.stored == [b"c"] and got.removed == [b"a"]
    assert log.since(2).stored == [] and not log.since(2).reset
    # no since, another epoch, or a sequence number from the future: the whole set
    for since, epoch in ((None, None), (1, "another-run"), (9, None)):
        got = log.since(since, epoch)
        assert got.reset and set(got.stored) == {b"b", b"c"} and got.removed == [] and got.seq == 2
    # the log keeps at most 4 hashes: entry 1 (and with it the way from 0) is dropped
    log.apply([b"d", b"e"], [])
    got = log.since(0)
    assert got.reset and set(got.stored) == {b"b", b"c", b"d", b"e"}
    got = log.since(1)
    assert not got.reset and set(got.stored) == {b"c", b"d", b"e"} and got.removed == [b"a"]
    log.clear()
    assert log.since(3).reset and log.cached == set()


def test_event_log_long_poll_wakes_on_a_change():
    async def main() -> float:
        log = KVEventLog(16)
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, log.apply, [b"x"], [])
        start = loop.time()
        await log.wait_after(0, timeout=5.0)
        assert log.seq == 1
        await log.wait_after(0, timeout=5.0)  # already past: no wait
        return loop.time() - start

    assert asyncio.run(main()) < 2.0


# ----------------------------------------------------------------------------- a live replica

ENGINE = dict(dtype="float32", num_threads=1, num_kv_blocks=16, max_num_seqs=8, max_num_batched_tokens=512)
BS = 16


@pytest.fixture(scope="module")
def replica(tiny_model_dir):
    client = AsyncEngineClient(KVServeConfig.from_kwargs(model=str(tiny_model_dir), **ENGINE))
    with ServerThread(client, ServerConfig(served_model_names=["tiny"], replica_id="r1")) as s:
        yield s


def complete(url: str, prompt: list[int]) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                   "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def events(url: str, **params) -> dict:
    r = httpx.get(f"{url}/kv/events", params=params, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_kv_events_route_lists_stores_evictions_and_resets(replica):
    url = replica.url
    first = events(url)
    assert first["reset"] and first["stored"] == [] and first["seq"] == 0 and first["replica_id"] == "r1"
    assert first["enabled"] and first["block_size"] == BS and first["load"]["running"] == 0
    scheme = HashScheme.from_json(first["hash_scheme"])
    assert scheme is not None and scheme.block_size == BS and scheme.root_key  # the model's fingerprint
    mirror = Backend(url)
    mirror.apply_events(first)

    rng = random.Random(0)
    prompt = [rng.randrange(3, 49152) for _ in range(40)]
    out = complete(url, prompt)
    assert out["usage"]["prompt_tokens"] == 40
    after = events(url, since=first["seq"], epoch=first["epoch"])
    mine = block_hashes(prompt, scheme)
    assert len(mine) == 2  # (40 - 1) // 16 full blocks; the 4 answer tokens fill no third block
    assert not after["reset"] and set(after["stored"]) == {h.hex() for h in mine} and after["removed"] == []
    mirror.apply_events(after)
    assert mirror.cached == set(mine)

    # the same prompt again is served from those blocks
    assert complete(url, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 32

    # 8 other prompts of 3 full blocks each overflow the 16-block pool: the LRU prompt is evicted
    seen = after["seq"]
    for i in range(8):
        complete(url, [rng.randrange(3, 49152) for _ in range(60)])
    later = events(url, since=seen, epoch=after["epoch"], wait=1)
    assert not later["reset"] and {h.hex() for h in mine} <= set(later["removed"])
    mirror.apply_events(later)
    assert not mirror.cached & set(mine)
    # the mirror, kept by increments, is exactly the cache's set
    snapshot = events(url)
    assert snapshot["reset"] and {bytes.fromhex(h) for h in snapshot["stored"]} == mirror.cached
    assert len(mirror.cached) == snapshot["num_cached_blocks"] > 0

    # another run's epoch, or a sequence number the log no longer reaches back to: reset and snapshot
    assert events(url, since=later["seq"], epoch="not-this-run")["reset"]
    replica.client.kv_events.max_hashes = 4  # (a small log, so that it drops old entries)
    complete(url, [rng.randrange(3, 49152) for _ in range(60)])
    stale = events(url, since=seen, epoch=after["epoch"])
    assert stale["reset"] and stale["removed"] == []
    assert {bytes.fromhex(h) for h in stale["stored"]} == replica.client.kv_events.cached


def test_kv_events_need_the_api_key_when_there_is_one(replica):
    config = replica.app.state.server.config
    config.api_key = "k"  # (as --api-key would; the route reads it per request)
    try:
        r = httpx.get(f"{replica.url}/kv/events")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{replica.url}/kv/events", headers={"Authorization": "Bearer k"}).status_code == 200
    finally:
        config.api_key = None
