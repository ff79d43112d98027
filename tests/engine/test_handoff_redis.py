"""Disaggregated prefill and decode through the shared Redis tier (``--kv-connector shared-tier`` with
``--kv-offload-url``), the second KV connector, against a real redis-server on 127.0.0.1: greedy
answers through the split equal one engine's and the decode engine restores every full block from
Redis; a corrupt transfer (entries flipped in Redis) or a missing one (nothing was sent) falls back to
recomputing, with the same answer."""

from __future__ import annotations

import shutil

import pytest

from engine.test_handoff import PROMPT, decode, prefill, replica, want  # noqa: F401 (a fixture)
from redis_server import RedisServer, free_port
from kvserve.kv.redis_tier import KEY_PREFIX, RedisTier

pytestmark = pytest.mark.component
redis = pytest.importorskip("redis")
if shutil.which("redis-server") is None:
    pytest.skip("no redis-server on the PATH (Debian: apt-get install redis-server; make test does as root)",
                allow_module_level=True)


@pytest.fixture
def server():
    s = RedisServer(free_port())
    s.start()
    yield s
    s.stop()


def split(url: str, **kw):
    kw = dict(kv_offload_url=url, kv_connector="shared-tier", **kw)
    return replica(role="prefill", **kw), replica(role="decode", **kw)


def flush(llm) -> None:
    for tier in llm.engine.kv.tiers.tiers:
        if isinstance(tier, RedisTier):
            tier.flush()


def test_split_through_redis_equals_one_engine(want, server):
    p, d = split(server.url)
    first = prefill(p, "", "r1")
    assert first == want[0]
    out = decode(d, "r1", first)
    assert out.token_ids == want
    assert out.num_cached_tokens == 44  # every full block came through Redis
    assert d.engine.kv.stats.tier_hits["redis"] == 44
    assert d.core.handoff.stats["received_transfers"] == 1


def test_corrupt_transfer_in_redis_is_recomputed(want, server):
    p, d = split(server.url)
    first = prefill(p, "", "r2")
    flush(p)
    client = redis.Redis(port=server.port)
    keys = client.keys(KEY_PREFIX + b"*")
    assert len(keys) >= 11
    for k in keys:  # a flipped byte in every block's payload, after its checksum was taken
        data = bytearray(client.get(k))
        data[-1] ^= 0xFF
        client.set(k, bytes(data))
    out = decode(d, "r2", first)
    assert out.token_ids == want
    assert out.num_cached_tokens == 0
    assert next(t for t in d.engine.kv.tiers.tiers if isinstance(t, RedisTier)).stats.corrupt >= 1


def test_missing_transfer_times_out_and_recomputes(want, server):
    _, d = split(server.url, kv_transfer_timeout_s=0.3)
    out = decode(d, "r3", want[0])  # no prefill replica ever sent this prompt
    assert out.token_ids == want and out.num_cached_tokens == 0
    assert d.core.handoff.stats["recomputed_transfers"] == 1
