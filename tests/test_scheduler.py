"""Scheduler and block pool, driven without a model: pure bookkeeping."""

import sys

import pytest

from kvserve.engine.batch import StepOutput
from kvserve.engine.request import FinishReason, Request, SamplingParams
from kvserve.engine.scheduler import Scheduler, SchedulerConfig
from kvserve.kv.block_pool import BlockPool, KVManager


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8):
    kv = KVManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), kv), kv


def req(rid, n_prompt, max_tokens=4):
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def fake_step(s: Scheduler):
    batch = s.schedule()
    out = StepOutput(token_ids={c.request.request_id: 7 for c in batch.chunks if c.sample})
    s.update(batch, out)
    return batch


def test_scheduler_and_kv_import_no_torch():
    import subprocess

    code = ("import sys, kvserve.engine.scheduler, kvserve.engine.engine, kvserve.engine.process, kvserve.kv.block_pool; "
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
