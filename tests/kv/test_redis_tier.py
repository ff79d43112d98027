"""The Redis KV tier against a real redis-server (Debian's, started here on 127.0.0.1): two engines
sharing one Redis (the second restores the first's blocks, same greedy output), corrupt and
foreign entries are misses, and Redis going away costs no request, one warning, and comes back."""

from __future__ import annotations

import logging
import random
import shutil
import time

import pytest

from conftest import hf_weights, kvserve_config, tiny_hf_model
from redis_server import RedisServer, free_port
from kvserve import SamplingParams
from kvserve.kv.redis_tier import KEY_PREFIX, RedisTier
from kvserve.llm import LLM

pytestmark = pytest.mark.component
redis = pytest.importorskip("redis")
if shutil.which("redis-server") is None:
    pytest.skip("no redis-server on the PATH (Debian: apt-get install redis-server; make test does as root)",
                allow_module_level=True)

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BS = 4


@pytest.fixture
def server():
    s = RedisServer(free_port())
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model():
    hf = tiny_hf_model(kv_heads=2)
    return kvserve_config(hf), hf_weights(hf)


def make_llm(model, **kw):
    cfg, w = model
    return LLM.from_weights(cfg, w, dtype="float32", num_kv_blocks=64, block_size=BS, max_num_batched_tokens=24, **kw)


def generate(llm, prompt):
    out = llm.generate([prompt], GREEDY)[0]
    for tier in llm.engine.kv.tiers.tiers:
        if isinstance(tier, RedisTier):
            tier.flush()
    return out.token_ids, out.num_cached_tokens


@pytest.mark.parametrize("kv", ["auto", "fp8", "int8"])  # an 8-bit block's payload carries its scales
def test_a_second_engine_restores_the_first_ones_blocks(model, server, kv):
    rng = random.Random(1)
    p = [rng.randrange(3, 97) for _ in range(33)]
    want, _ = generate(make_llm(model, kv_cache_dtype=kv), p)
    first = make_llm(model, kv_offload_url=server.url, kv_cache_dtype=kv)
    assert generate(first, p)[0] == want
    tier = first.engine.kv.tiers.tiers[0]
    assert tier.written >= 8  # every full block, saved when computed (nothing was evicted)
    second = make_llm(model, kv_offload_url=server.url, kv_cache_dtype=kv)  # another replica, same Redis
    got, cached = generate(second, p)
    assert got == want and cached == 32
    assert second.engine.kv.stats.tier_hits["redis"] == 32
    # the second engine does not save again what it restored: only the blocks its decode filled
    assert second.engine.kv.tiers.tiers[0].written == tier.written - 8


def test_corrupt_and_foreign_entries_are_misses(model, server):
    rng = random.Random(2)
    p = [rng.randrange(3, 97) for _ in range(33)]
    want, _ = generate(make_llm(model), p)
    generate(make_llm(model, kv_offload_url=server.url), p)
    client = redis.Redis(port=server.port)
    keys = client.keys(KEY_PREFIX + b"*")
    assert len(keys) >= 8  # the prompt's 8 full blocks and those its decode filled
    for k in keys:  # flip the last byte of every stored block
        data = bytearray(client.get(k))
        data[-1] ^= 0xFF
        client.set(k, bytes(data))
    reader = make_llm(model, kv_offload_url=server.url)
    got, cached = generate(reader, p)
    assert got == want and cached == 0
    assert reader.engine.kv.tiers.tiers[0].stats.corrupt >= 1

    client.flushdb()
    generate(make_llm(model, kv_offload_url=server.url), p)
    other_hf = tiny_hf_model(kv_heads=2, seed=1)  # same shapes, other weights: another fingerprint
    other = LLM.from_weights(kvserve_config(other_hf), hf_weights(other_hf), dtype="float32", num_kv_blocks=64,
                             block_size=BS, kv_offload_url=server.url)
    own = LLM.from_weights(kvserve_config(other_hf), hf_weights(other_hf), dtype="float32", block_size=BS)
    assert generate(other, p) == (generate(own, p)[0], 0)


def test_redis_down_costs_no_request_and_one_warning_then_resumes(model, server, caplog):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 97) for _ in range(33)] for _ in range(4)]
    base = make_llm(model)
    want = [generate(base, p)[0] for p in prompts]
    llm = make_llm(model, kv_offload_url=server.url)
    tier = llm.engine.kv.tiers.tiers[0]
    tier.retry_s = 0.5
    assert generate(llm, prompts[0])[0] == want[0]
    server.stop()
    caplog.set_level(logging.WARNING, logger="kvserve.kv.redis_tier")
    for p, w in zip(prompts[1:3], want[1:3]):  # served without the tier
        assert generate(llm, p)[0] == w
    warnings = [r for r in caplog.records if "turned off" in r.getMessage()]
    assert len(warnings) == 1 and server.url in warnings[0].getMessage()
    server.start()  # the same port: an empty Redis
    time.sleep(0.6)
    assert generate(llm, prompts[3])[0] == want[3]
    assert any("is back" in r.getMessage() for r in caplog.records)
    tier.flush()
    assert redis.Redis(port=server.port).dbsize() >= 8  # writing again


def test_bad_url_is_a_config_error():
    from kvserve.config import KVServeConfig
    from kvserve.errors import InvalidArgumentError

    with pytest.raises((InvalidArgumentError, ValueError)) as e:
        KVServeConfig.from_kwargs(kv_offload_url="http://127.0.0.1:6379")
    assert "kv-offload-url" in str(e.value)
