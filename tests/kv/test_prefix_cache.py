"""The radix prefix cache, cache-aware policies and the host/disk offload tiers.

Each test checks exact block accounting after every step (``KVManager.check``) and that
outputs do not change when KV comes from the cache or a tier instead of a forward pass.
"""

import random
from pathlib import Path

import pytest

from conftest import hf_weights, kvserve_config, tiny_hf_model
from kvserve import SamplingParams
from kvserve.engine.batch import StepOutput
from kvserve.engine.request import Request
from kvserve.config import SchedulerConfig
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.manager import KVManager
from kvserve.kv.radix_cache import RadixCache
from kvserve.kv.block_pool import BlockPool
from kvserve.llm import LLM

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BS = 4


@pytest.fixture(scope="module")
def model():
    hf = tiny_hf_model(kv_heads=2)
    return kvserve_config(hf), hf_weights(hf)


def make_llm(model, **kw):
    cfg, w = model
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", BS)
    kw.setdefault("max_num_batched_tokens", 24)
    return LLM.from_weights(cfg, w, **kw)


def run(llm, prompts, params=GREEDY, abort_after: dict[int, int] | None = None):
    """All prompts at once through the engine, checking the block accounting after every step.
    Returns (outputs, cached_tokens) in prompt order."""
    eng = llm.engine
    reqs = [eng.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        eng.kv.check()
        for i, n in (abort_after or {}).items():
            if steps == n:
                eng.abort(f"r{i}")
    for i, _ in enumerate(prompts):
        eng.scheduler.requests.pop(f"r{i}", None)
    return [r.output_token_ids for r in reqs], [r.num_cached_tokens for r in reqs]


def shared_prompts(seed=0):
    """Prompts sharing a prefix that ends at, before and inside block boundaries."""
    rng = random.Random(seed)
    base = [rng.randrange(3, 97) for _ in range(30)]
    tail = lambda n: [rng.randrange(3, 97) for _ in range(n)]  # noqa: E731
    return [
        base,
        base[:8] + tail(9),  # diverges at a block boundary
        base[:7] + tail(10),  # one token before it
        base[:10] + tail(5),  # inside a block
        base[:16],  # a prefix of another prompt, ending on a boundary
        list(base),  # the same prompt twice
        base + tail(3),  # extends another prompt
    ]


def test_outputs_identical_with_cache_on_and_off(model):
    ps = shared_prompts()
    off, cached_off = run(make_llm(model, enable_prefix_caching=False), ps)
    llm = make_llm(model)
    first, _ = run(llm, ps)  # concurrent: prefixes shared among requests in flight
    second, cached = run(llm, ps)  # again: now the tree holds every prefix
    assert first == off and second == off
    assert cached_off == [0] * len(ps)
    # full blocks of each prompt, leaving the last token to compute
    assert cached == [(len(p) - 1) // BS * BS for p in ps]
    assert llm.engine.kv.stats.hits > 0
    assert llm.engine.kv.num_available_blocks == llm.engine.kv.pool.num_blocks


def test_eviction_under_pressure_keeps_outputs_and_accounting(model):
    rng = random.Random(3)
    system = [rng.randrange(3, 97) for _ in range(12)]
    ps = [system + [rng.randrange(3, 97) for _ in range(rng.randrange(4, 20))] for _ in range(12)]
    off, _ = run(make_llm(model, enable_prefix_caching=False, num_kv_blocks=256), ps)
    llm = make_llm(model, num_kv_blocks=20)  # forces eviction and preemption
    got, _ = run(llm, ps)
    assert got == off
    got2, _ = run(llm, ps)
    assert got2 == off
    kv = llm.engine.kv
    assert kv.stats.evicted_blocks > 0
    assert kv.num_available_blocks == kv.pool.num_blocks and not kv.tables


def test_abort_one_of_two_sharing_requests(model):
    p = shared_prompts()[0]
    alone, _ = run(make_llm(model), [p])
    llm = make_llm(model)
    got, _ = run(llm, [p, p + [5, 6]], params=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                 abort_after={1: 3})
    full, _ = run(make_llm(model), [p], params=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert got[0] == full[0] and got[0][:8] == alone[0]
    assert llm.engine.kv.num_available_blocks == llm.engine.kv.pool.num_blocks


def test_radix_eviction_is_lru_and_never_frees_blocks_in_use():
    pool = BlockPool(8, 2)
    cache = RadixCache(pool)
    a, b = pool.allocate(2), pool.allocate(2)
    cache.insert([1, 2, 3, 4], a)
    cache.insert([1, 2, 5, 6], b)  # shares the first block with a: tree keeps a[0]
    pool.release(a)
    pool.release(b)  # b[0] was never cached: back to the free list
    assert pool.num_free == 8 - 3 and pool.num_evictable == 3
    cache.match([1, 2, 3, 4])  # touch a's branch: b's leaf is now the oldest
    pool.share(a[1])  # a request holds a's leaf
    freed = cache.evict(1)
    assert [n.block for n in freed] == [b[1]]
    # Only a[0] is left to evict; dropping it drops its subtree from the tree, but a[1] stays
    # allocated to the request that holds it.
    freed = cache.evict(5)
    assert [n.block for n in freed] == [a[0]]
    assert pool.ref_count(a[1]) == 1 and not pool.is_cached(a[1])
    assert cache.match_length([1, 2, 3, 4]) == 0


def test_lpm_beats_fcfs_hit_rate_on_a_tight_budget():
    """Two documents' requests interleaved; a pool that holds one document's KV at a time."""

    def hit_rate(policy: str) -> float:
        kv = KVManager(14, 4)  # one document (10 blocks) and one request's own blocks
        s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, schedule_policy=policy, prefill_step_factor=0.0), kv)
        docs = [[d * 50 + i for i in range(40)] for d in (1, 2)]
        for i in range(16):
            s.add(Request(f"q{i}", docs[i % 2] + [200 + i, 201 + i], SamplingParams(max_tokens=2, ignore_eos=True)))
        while s.has_unfinished():
            batch = s.schedule()
            s.update(batch, StepOutput(token_ids={c.request.request_id: [7] for c in batch.chunks if c.sample}))
            kv.check()
        return kv.stats.hits / kv.stats.queries

    assert hit_rate("lpm") > hit_rate("fcfs") + 0.1
    assert hit_rate("dfs-weight") > hit_rate("fcfs") + 0.1


def test_starvation_guard_bounds_every_wait():
    """A request whose prefix is never cached would wait forever behind an endless stream of
    cache hits under lpm; past the bound it goes first."""
    now = [0.0]
    kv = KVManager(64, 4)
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, schedule_policy="lpm", prefill_step_factor=0.0,
                                  starvation_timeout_s=5.0), kv, clock=lambda: now[0])
    hot = list(range(1, 33))

    def step():
        batch = s.schedule()
        s.update(batch, StepOutput(token_ids={c.request.request_id: [7] for c in batch.chunks if c.sample}))

    s.add(Request("warm", hot + [99], SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=0.0))
    step()  # the hot prefix is now cached
    s.add(Request("cold", [90] * 20, SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=0.0))
    i = 0
    while "cold" in s.requests:
        s.add(Request(f"hot{i}", hot + [100 + i], SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=now[0]))
        i += 1
        step()
        now[0] += 1.0
        assert now[0] < 10, "the cold request starved"
    assert now[0] > 5  # it did wait behind cache hits until the bound


def _evict_everything(llm, rng, n=12):
    """Fill the device pool with unrelated prompts so earlier blocks are evicted."""
    run(llm, [[rng.randrange(3, 97) for _ in range(40)] for _ in range(n)])


def test_host_tier_restores_evicted_prefix(model):
    rng = random.Random(5)
    p = [rng.randrange(3, 97) for _ in range(33)]
    want, _ = run(make_llm(model), [p])
    llm = make_llm(model, num_kv_blocks=24, kv_offload_memory_gb=0.01)
    run(llm, [p])
    _evict_everything(llm, rng)
    kv = llm.engine.kv
    assert kv.cache.match_length(p) == 0  # gone from the device
    before = kv.stats.tier_hits["host"]
    got, cached = run(llm, [p])
    assert got == want
    assert cached == [32] and kv.stats.tier_hits["host"] - before == 32
    assert kv.stats.offload_bytes_out > 0 and kv.stats.offload_bytes_in > 0


def test_disk_tier_survives_restart_and_rejects_corruption(model, tmp_path: Path):
    rng = random.Random(6)
    p = [rng.randrange(3, 97) for _ in range(33)]
    want, _ = run(make_llm(model), [p])
    llm = make_llm(model, num_kv_blocks=24, kv_offload_dir=str(tmp_path))
    run(llm, [p])
    _evict_everything(llm, rng)
    assert len(list(tmp_path.glob("*.kvb"))) > 0

    restarted = make_llm(model, num_kv_blocks=24, kv_offload_dir=str(tmp_path))  # a fresh engine, same dir
    got, cached = run(restarted, [p])
    assert got == want and cached == [32]
    assert restarted.engine.kv.stats.tier_hits["disk"] == 32

    # corrupt every stored entry: each must be detected and ignored, the output unchanged
    for f in tmp_path.glob("*.kvb"):
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    again = make_llm(model, num_kv_blocks=24, kv_offload_dir=str(tmp_path))
    got, cached = run(again, [p])
    assert got == want and cached == [0]
    disk = again.engine.kv.tiers.tiers[0]
    assert disk.stats.corrupt == 1  # the first block's check fails: the rest of the chain is a miss


def test_disk_tier_rejects_a_foreign_model(model, tmp_path: Path):
    rng = random.Random(7)
    p = [rng.randrange(3, 97) for _ in range(33)]
    llm = make_llm(model, num_kv_blocks=24, kv_offload_dir=str(tmp_path))
    run(llm, [p])
    _evict_everything(llm, rng)
    other_hf = tiny_hf_model(kv_heads=2, seed=1)  # same shape, other weights
    other = LLM.from_weights(kvserve_config(other_hf), hf_weights(other_hf), dtype="float32", num_kv_blocks=24,
                             block_size=BS, kv_offload_dir=str(tmp_path))
    want, _ = run(LLM.from_weights(kvserve_config(other_hf), hf_weights(other_hf), dtype="float32", block_size=BS), [p])
    got, cached = run(other, [p])
    assert got == want and cached == [0]


def test_tier_restore_skipped_when_prefilling_again_is_cheaper():
    """The manager alone: an evicted prefix sits in the host tier; whether a hit restores it
    depends on the predicted prefill time against the copy time."""
    from kvserve.kv.tiers import HostTier

    def setup(prefill_s):
        kv = KVManager(4, 4, tiers=[HostTier(1 << 20, bandwidth=1e6, latency=0.0)], block_bytes=1000)
        kv.prefill_seconds = lambda start, n: prefill_s
        prompt = list(range(1, 10))  # two full blocks before the last token
        kv.match_prefix("a", prompt)
        kv.grow("a", 9)
        kv.cache_blocks("a", prompt, 9)
        kv.free("a")
        kv.grow("b", 16)  # needs every block: evicts a's two cached blocks
        saves = kv.take_transfers()
        assert [t.kind for t in saves] == ["save", "save"]
        kv.complete_saves(saves, {t.key: bytes(1000) for t in saves})
        kv.free("b")
        kv.check()
        return kv, kv.match_prefix("c", prompt)

    # copying 2 x 1000 bytes at 1 MB/s takes 2 ms
    kv, m = setup(prefill_s=0.5)
    assert m.num_tokens == 8 and m.tier_tokens == {"host": 8}
    assert [t.kind for t in kv.take_transfers()] == ["load", "load"]
    kv, m = setup(prefill_s=0.001)
    assert m.num_tokens == 0 and kv.stats.restores_skipped == 2 and not kv.take_transfers()


def test_a_prefix_being_prefilled_is_not_computed_twice():
    """Two requests with one long shared prefix arrive together: the second shares the blocks the
    first fills in the same step and computes only its own tail beside it. With the first's prompt
    cut into chunks, the second waits for each next chunk rather than compute it beside the first,
    and joins the step in which the first fills the last block they share. Without in-step sharing
    it waits a step for the blocks to be cached."""
    shared = list(range(1, 41))

    def two(budget: int, share: bool = True) -> tuple[KVManager, Scheduler]:
        kv = KVManager(64, 4)
        s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, prefill_step_factor=0.0,
                                      share_prefix_in_step=share), kv)
        s.add(Request("a", shared + [90], SamplingParams(max_tokens=2, ignore_eos=True)))
        s.add(Request("b", shared + [91, 92], SamplingParams(max_tokens=2, ignore_eos=True)))
        return kv, s

    def step(kv: KVManager, s: Scheduler) -> dict[str, object]:
        batch = s.schedule()
        kv.check()
        s.update(batch, StepOutput(token_ids={c.request.request_id: [7] for c in batch.chunks if c.sample}))
        kv.check()
        return {c.request.request_id: c for c in batch.chunks}

    kv, s = two(64)
    chunks = step(kv, s)
    a, b = chunks["a"], chunks["b"]
    assert (a.start, a.num_tokens, b.start, b.num_tokens) == (0, 41, 40, 2)
    assert b.block_table[:10] == a.block_table[:10]  # the same blocks, written once in this step
    assert s.requests["b"].num_cached_tokens == 40 and kv.stats.device_hits == 40

    kv, s = two(16)
    seen = [{rid: (c.start, c.num_tokens) for rid, c in step(kv, s).items()} for _ in range(3)]
    assert seen == [{"a": (0, 16)}, {"a": (16, 16)}, {"a": (32, 9), "b": (40, 2)}]

    kv, s = two(64, share=False)  # SGLang's in-batch check (the simulator's sglang profile): b waits a step
    seen = [{rid: (c.start, c.num_tokens) for rid, c in step(kv, s).items()} for _ in range(2)]
    assert seen[0] == {"a": (0, 41)} and seen[1]["b"] == (40, 2)


def test_a_disk_tier_that_cannot_write_turns_itself_off_with_one_warning(tmp_path: Path, monkeypatch, caplog):
    """A full or read-only disk (ENOSPC/EROFS on write): the tier disables itself once, logs one
    warning, and answers as empty from then on; nothing raises into the engine."""
    import errno
    import logging

    from kvserve.kv.disk_tier import DiskTier

    tier = DiskTier(tmp_path / "kv", 1 << 20, b"fp")

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    with caplog.at_level(logging.WARNING, logger="kvserve.kv.tiers"):
        for i in range(3):
            tier.put(bytes([i]) * 16, (1, 2, 3), b"x" * 64)
    assert not tier.enabled and bytes([0]) * 16 not in tier
    assert len([r for r in caplog.records if "turned off" in r.getMessage()]) == 1
    assert not list((tmp_path / "kv").glob("*.tmp"))


@pytest.mark.parametrize("backend", ["gather-sdpa", "paged"])
def test_prompts_sharing_blocks_filled_in_the_same_step_generate_what_they_generate_alone(model, backend):
    """Four prompts on one 30-token prefix arrive together on an empty cache: the first computes the
    prefix, the others share its blocks in that same step (their rows read K/V written by the first's
    rows in each layer). Greedy tokens equal each prompt's run alone without a prefix cache."""
    from kvserve.kernels import load_kernels

    if backend == "paged" and not load_kernels():
        pytest.skip("native kernels did not build")
    rng = random.Random(7)
    shared = [rng.randrange(3, 97) for _ in range(30)]
    prompts = [shared + [rng.randrange(3, 97) for _ in range(n)] for n in (3, 9, 1, 14)]
    llm = make_llm(model, attention_backend=backend, max_num_batched_tokens=256)
    together = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert llm.engine.kv.stats.device_hits == 3 * 28  # 7 full blocks each, shared within the one step
    alone = [make_llm(model, attention_backend=backend, enable_prefix_caching=False).generate([p], GREEDY)[0].token_ids
             for p in prompts]
    assert together == alone
