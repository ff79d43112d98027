"""Scheduler and block pool, driven without a model: pure bookkeeping."""

import sys

import pytest

from kvserve.engine.batch import StepOutput
from kvserve.engine.request import FinishReason, Request, SamplingParams
from kvserve.config import SchedulerConfig
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.manager import KVManager


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8, prefix_caching=False):
    kv = KVManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, prefill_step_factor=0.0), kv), kv


def req(rid, n_prompt, max_tokens=4):
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def fake_step(s: Scheduler):
    batch = s.schedule()
    out = StepOutput(token_ids={c.request.request_id: [7] for c in batch.chunks if c.sample})
    s.update(batch, out)
    return batch


def test_scheduler_and_kv_import_no_torch():
    import subprocess

    code = ("import sys, kvserve.engine.scheduler, kvserve.engine.engine, kvserve.engine.core, kvserve.engine.worker, kvserve.kv.block_pool; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_chunked_prefill_respects_budget_and_decodes_go_first():
    s, _ = make(budget=10)
    s.add(req("a", 25))
    sizes = []
    while s.requests["a"].num_computed_tokens < 25:
        b = fake_step(s)
        sizes.append(b.num_tokens)
    assert sizes == [10, 10, 5]  # the last chunk samples the first output token
    s.add(req("b", 30))
    b = s.schedule()
    assert [c.request.request_id for c in b.chunks] == ["a", "b"]
    assert b.chunks[0].num_tokens == 1 and b.chunks[0].is_decode
    assert b.chunks[1].num_tokens == 9  # the rest of the budget


def test_admission_waits_for_free_blocks_and_max_seqs():
    s, kv = make(num_blocks=4, block_size=4, budget=100, max_seqs=2)
    for i in range(3):
        s.add(req(str(i), 6, max_tokens=1))
    b = s.schedule()
    assert [c.request.request_id for c in b.chunks] == ["0", "1"]  # 2 blocks each, pool of 4
    assert kv.num_free_blocks == 0 and s.num_waiting == 1


def test_preemption_takes_newest_and_recomputes():
    s, kv = make(num_blocks=4, block_size=4, budget=100)
    s.add(req("old", 7, max_tokens=20))
    s.add(req("new", 7, max_tokens=20))
    fake_step(s)  # both prefilled: 2 blocks each, pool full
    assert kv.num_free_blocks == 0
    fake_step(s)  # position 8 fits in the second block of each? 7 prompt + 1 out = 8 tokens: still 2 blocks
    b = s.schedule()  # 9th token needs a third block: the newest is preempted
    assert [r.request_id for r in b.preempted] == ["new"]
    new = s.requests["new"]
    assert new.num_computed_tokens == 0 and new.num_preemptions == 1 and s.waiting[0] is new
    assert s.stats.num_preemptions == 1


def test_every_block_free_after_finish_and_abort():
    s, kv = make(num_blocks=32, block_size=4, budget=8)
    for i in range(6):
        s.add(req(str(i), 5 + i, max_tokens=3 + i))
    for _ in range(3):
        fake_step(s)
    s.finish("2", FinishReason.ABORT)
    s.finish("4", FinishReason.ABORT)
    while s.has_unfinished():
        fake_step(s)
    assert kv.num_free_blocks == 32 and not kv.tables


def test_block_pool_refcounts():
    pool = BlockPool(4, 16)
    a = pool.allocate(2)
    pool.share(a[0])
    pool.release(a)
    assert pool.num_free == 3 and pool.ref_count(a[0]) == 1
    pool.release([a[0]])
    assert pool.num_free == 4
    with pytest.raises(AssertionError):
        pool.release([a[0]])


def test_step_cost_model_recovers_a_linear_cost():
    from kvserve.engine.step_cost import StepCostModel, StepFeatures

    m = StepCostModel()

    def truth(f):
        return (0.01 + 0.001 * f.decode_seqs + 0.0005 * f.decode_attention + 0.002 * f.prefill_tokens
                + 0.0003 * f.prefill_attention)

    steps = [(0, 8, 1.0, 0), (0, 16, 2.5, 0), (0, 32, 6.0, 0), (0, 1, 0.2, 0), (0, 12, 3.0, 0), (0, 4, 4.0, 0),
             (128, 0, 0, 9.0), (64, 8, 1.5, 5.0), (256, 4, 2.0, 40.0), (512, 0, 0, 130.0), (32, 2, 0.3, 1.5),
             (100, 10, 3.0, 20.0), (300, 3, 0.5, 70.0)]
    for p, d, da, pa in steps:
        f = StepFeatures(p, d, da, pa)
        m.observe(f, truth(f))
    assert m.ready
    probe = StepFeatures(1000, 20, 5.0, 300.0)
    assert m.predict(probe) == pytest.approx(truth(probe), rel=1e-3)
    assert m.decode_seconds(20, 5.0) == pytest.approx(0.01 + 0.02 + 0.0025, rel=1e-3)


def test_step_cost_model_keeps_prefill_priced_when_chunks_are_all_alike():
    """Steps whose prefill chunks all have the same size: a single regression lets the intercept
    absorb the prefill cost; the split fit still prices a prefill token."""
    from kvserve.engine.step_cost import StepCostModel, StepFeatures

    m = StepCostModel()
    for d in (2, 4, 6, 8, 3, 5, 7):
        m.observe(StepFeatures(0, d, d * 0.2), 0.05 + 0.002 * d)
    for i in range(40):
        d = 4 + i % 3
        m.observe(StepFeatures(2048, d, d * 0.2, 2048 * 2048 / 1024), 0.05 + 0.002 * d + 0.0025 * 2048)
    assert m.prefill_seconds(0, 2048) == pytest.approx(0.0025 * 2048, rel=0.05)
    assert m.decode_seconds(8, 1.6) == pytest.approx(0.05 + 0.016, rel=0.05)


def test_prefill_chunks_shrink_to_the_time_allowance_while_others_decode():
    from kvserve.engine.step_cost import StepFeatures

    s, _ = make(num_blocks=256, block_size=16, budget=2048)
    s.config.prefill_step_factor = 2.0
    s.config.metered_prefill_min_tokens = 256
    # a machine where a decode step costs 10 ms + 1 ms/seq and each prefill token 1 ms
    for p, d in [(0, 4), (0, 8), (16, 0), (64, 4), (256, 0), (0, 2), (32, 8), (128, 2), (0, 6), (8, 1), (512, 0),
                 (0, 3)]:
        s.cost.observe(StepFeatures(p, d, 0.0), 0.010 + 0.001 * d + 0.001 * p)
    for i in range(4):
        s.add(req(f"d{i}", 8, max_tokens=50))
    fake_step(s)  # all four prefilled (nobody was decoding yet: no time cap)
    s.add(req("long", 1000, max_tokens=2))
    b = s.schedule()
    long_chunk = [c for c in b.chunks if c.request.request_id == "long"][0]
    # decode-only step is predicted at 14 ms: prefill may add (2 - 1) x 14 ms = 14 tokens, floor 16
    assert long_chunk.num_tokens == 16
    assert sum(c.is_decode for c in b.chunks) == 4
    # a short prompt goes in whole beside them (metering it would only delay its first token),
    # and the long prompt's chunk gets what is left of the allowance: only the floor
    s.add(req("short", 200, max_tokens=2))
    s.update(b, StepOutput(token_ids={c.request.request_id: [7] for c in b.chunks if c.sample}))
    b = s.schedule()
    sizes = {c.request.request_id: c.num_tokens for c in b.chunks}
    assert sizes["short"] == 200 and sizes["long"] == 16 and sum(c.is_decode for c in b.chunks) == 4
    # the long prompt stays metered to its end: its last 256 tokens do not become a "short" prompt
    long_sizes = []
    for _ in range(40):
        s.update(b, StepOutput(token_ids={c.request.request_id: [7] for c in b.chunks if c.sample}))
        b = s.schedule()
        long_sizes += [c.num_tokens for c in b.chunks if c.request.request_id == "long" and not c.is_decode]
    assert long_sizes and max(long_sizes) <= 16
    s.config.prefill_step_factor = 0  # off: the whole token budget again
    s.update(b, StepOutput(token_ids={c.request.request_id: [7] for c in b.chunks if c.sample}))
    b = s.schedule()
    assert [c.num_tokens for c in b.chunks if c.request.request_id == "long"] == [1000 - 32 - sum(long_sizes)]


def test_prefill_only_steps_hold_decodes_back_until_the_prefill_is_done():
    """mixed_prefill off (SGLang's default): a step with prefill work carries only prefill chunks, its
    running requests' decodes wait, and they decode again once the prompt is in (chunks included)."""
    kv = KVManager(64, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, prefill_step_factor=0.0,
                                  mixed_prefill=False), kv)
    s.add(req("a", 6, max_tokens=8))
    fake_step(s)  # a's prompt
    assert [c.is_decode for c in fake_step(s).chunks] == [True]
    s.add(req("b", 15))
    steps = [[(c.request.request_id, c.num_tokens) for c in fake_step(s).chunks] for _ in range(3)]
    assert steps == [[("b", 10)], [("b", 5)], [("a", 1), ("b", 1)]]  # b's chunks alone, then both decode
    # the vLLM way (the default): the decode and the new prompt's chunk share the step
    s2, _ = make(budget=10)
    s2.add(req("a", 6, max_tokens=8))
    fake_step(s2)
    s2.add(req("b", 15))
    assert [(c.request.request_id, c.num_tokens) for c in fake_step(s2).chunks] == [("a", 1), ("b", 9)]


def test_prefill_only_steps_decode_when_nothing_can_be_admitted():
    """A waiting request that cannot get its blocks must not stall the running ones: they decode."""
    kv = KVManager(4, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, prefill_step_factor=0.0,
                                  mixed_prefill=False), kv)
    s.add(req("a", 8, max_tokens=4))  # 2 of the 4 blocks, 3 once it decodes
    fake_step(s)
    s.add(req("b", 12))  # needs 3 blocks: waits
    b = fake_step(s)
    assert [(c.request.request_id, c.is_decode) for c in b.chunks] == [("a", True)]
    assert [r.request_id for r in s.waiting] == ["b"]
