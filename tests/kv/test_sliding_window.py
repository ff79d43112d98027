"""Sliding windows in the KV manager (torch-free): a sequence of a model whose every layer has a window
lets go of the blocks behind it (placeholders keep its table aligned with positions), the prefix cache
keeps its references, tiers never see a placeholder, the accounting stays exact, and the scheduler
runs in a pool too small for the sequences' whole contexts."""

from __future__ import annotations

import math
import random

import pytest

from kvserve import SamplingParams
from kvserve.config import SchedulerConfig
from kvserve.engine.batch import ScheduledChunk, StepOutput
from kvserve.engine.inflight_prefix import blocks_filled_this_step
from kvserve.engine.request import Request
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.block_pool import NO_BLOCK
from kvserve.kv.manager import KVManager
from kvserve.kv.tiers import HostTier
from kvserve.model.config import ModelConfig

W, BS = 10, 4
MOST = math.ceil(W / BS) + 1  # blocks a decoding sequence can need: its window's, one part-filled at each end


def decode_through(kv: KVManager, seq: str, tokens: list[int]) -> None:
    """Compute ``tokens`` one position a step as the scheduler does: slide to the step's first row,
    grow, then cache what is computed; checks the table and the accounting at every step."""
    for pos in range(len(tokens)):
        kv.slide(seq, pos)
        kv.grow(seq, pos + 1)
        table = kv.table(seq)
        gone = max(0, pos - W + 1) // BS
        assert len(table) == kv.pool.blocks_for(pos + 1)  # still one entry per block of positions
        assert table[:gone] == [NO_BLOCK] * gone and NO_BLOCK not in table[gone:]
        assert kv.num_held(seq) <= MOST
        kv.cache_blocks(seq, tokens, pos + 1)
        kv.check()


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_a_long_sequence_holds_only_its_window(caching):
    kv = KVManager(64, BS, enable_prefix_caching=caching, sliding_window=W)
    tokens = [random.Random(0).randrange(3, 97) for _ in range(200)]  # 50 blocks: more than the pool holds
    decode_through(kv, "a", tokens)
    assert kv.num_held("a") <= MOST
    kv.free("a")
    kv.check()
    assert kv.num_available_blocks == kv.pool.num_blocks


def test_the_prefix_cache_keeps_the_blocks_a_window_released():
    kv = KVManager(64, BS, sliding_window=W)
    tokens = list(range(3, 3 + 40))
    decode_through(kv, "a", tokens)
    # the sequence let go of its early blocks; the tree still holds each full block (then evictable)
    assert kv.num_cached_blocks == 10
    early = [n for n in kv.cache._nodes() if n.depth <= 5]
    assert all(kv.pool.ref_count(n.block) == 1 and kv.pool.is_cached(n.block) for n in early)
    # a hit gets every block of its prefix, none a placeholder, and itself lets go of what it will not read
    m = kv.match_prefix("b", tokens + [99])
    assert m.num_tokens == 40 and NO_BLOCK not in kv.table("b")
    kv.check()
    assert kv.slide("b", m.num_tokens) == (40 - W + 1) // BS
    assert kv.num_cached_blocks == 10
    kv.free("a")
    kv.free("b")
    kv.check()
    assert kv.num_cached_blocks == 10 and kv.num_available_blocks == kv.pool.num_blocks


def test_caching_resumes_nowhere_past_a_released_block_whose_node_was_evicted():
    """Evicting a released early block drops its subtree (the sequence's later nodes too); caching the
    sequence again from the root must stop at the placeholder, not share block -1."""
    kv = KVManager(64, BS, sliding_window=W)
    tokens = list(range(3, 3 + 80))
    decode_through(kv, "a", tokens[:40])
    kv.cache.evict(64)
    kv.check()
    assert kv.num_cached_blocks == 0
    for pos in range(40, 80):
        kv.slide("a", pos)
        kv.grow("a", pos + 1)
        kv.cache_blocks("a", tokens, pos + 1)
        kv.check()
    assert kv.num_cached_blocks == 0  # nothing after the gap can be reached from the root


def test_tiers_save_and_restore_real_blocks_only():
    kv = KVManager(16, BS, tiers=[HostTier(1 << 20)], sliding_window=W)
    tokens = list(range(3, 3 + 48))
    decode_through(kv, "a", tokens)
    kv.free("a")
    other = list(range(100, 100 + 60))
    decode_through(kv, "b", other)  # evicts a's cached blocks into the host tier
    saves = [t for t in kv.take_transfers() if t.kind == "save"]
    assert saves and all(0 <= t.block < kv.pool.num_blocks for t in saves)
    kv.complete_saves(saves, {t.key: b"kv" for t in saves})
    kv.free("b")
    m = kv.match_prefix("c", tokens + [1])
    loads = [t for t in kv.take_transfers() if t.kind == "load"]
    assert m.tier_tokens and loads and all(0 <= t.block < kv.pool.num_blocks for t in loads)
    assert NO_BLOCK not in kv.table("c")
    kv.check()


def test_a_chunk_whose_table_begins_with_placeholders_lends_nothing():
    prompt = list(range(3, 3 + 40))
    a, b = Request("a", prompt, SamplingParams()), Request("b", prompt + [5], SamplingParams())
    chunk = ScheduledChunk(a, 24, 16, [NO_BLOCK] * 3 + list(range(7)))
    assert blocks_filled_this_step([chunk], b, 0, BS, lambda rid: chunk.block_table) == []


def run_scheduler(window: int | None, num_blocks: int, budget: int, spec_drafts: bool = False,
                  caching: bool = True, prompts: list[list[int]] | None = None) -> tuple[Scheduler, int]:
    """Requests through the real scheduler with a stand-in runner (every sampled token 7); returns the
    scheduler and the most blocks any sequence held after a step's grow, beyond what its chunk adds."""
    kv = KVManager(num_blocks, BS, enable_prefix_caching=caching, sliding_window=window)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, prefill_step_factor=0.0), kv)
    rng = random.Random(1)
    for i, p in enumerate(prompts or [[rng.randrange(3, 97) for _ in range(30 + 7 * i)] for i in range(4)]):
        s.add(Request(f"r{i}", p, SamplingParams(max_tokens=60, ignore_eos=True)))
    worst = 0
    while s.has_unfinished():
        batch = s.schedule()
        kv.check()
        for c in batch.chunks:
            if window is not None:  # the first row's window, plus the chunk's own rows
                assert kv.num_held(c.request.request_id) <= math.ceil((window - 1 + c.num_tokens) / BS) + 1
                worst = max(worst, kv.num_held(c.request.request_id) - kv.pool.blocks_for(c.num_tokens))
            assert all(b != NO_BLOCK for b in c.block_table[max(0, c.start - (window or c.start) + 1) // BS:])
        s.update(batch, StepOutput(token_ids={c.request.request_id: [7] for c in batch.chunks if c.sample}))
        kv.check()
    assert kv.num_available_blocks == kv.pool.num_blocks
    return s, worst


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_windowed_sequences_fit_a_pool_too_small_for_their_contexts(caching):
    # 4 sequences of 90-111 tokens need 104 blocks of 4 in all; 32 hold their windows and chunks
    s, worst = run_scheduler(W, 32, 16, caching=caching)
    assert s.stats.num_preemptions == 0 and s.stats.num_generated_tokens == 240
    assert worst <= MOST
    s, _ = run_scheduler(None, 32, 16, caching=caching)  # the same without a window: preempted
    assert s.stats.num_preemptions > 0


def test_preemption_with_windows_stays_exact():
    s, _ = run_scheduler(W, 12, 16)  # too small even for four windows: some are preempted, all finish
    assert s.stats.num_preemptions > 0 and s.stats.num_generated_tokens == 240


def test_prefix_hits_with_windows():
    shared = list(range(3, 3 + 40))
    prompts = [shared + [50 + i] * (1 + i) for i in range(4)]
    s, _ = run_scheduler(W, 32, 16, prompts=prompts)
    assert s.kv.stats.device_hits >= 3 * 40 - 3 * BS  # the later prompts take the first one's blocks
    assert s.stats.num_preemptions == 0


def test_kv_window_is_set_only_when_every_layer_has_one():
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    assert ModelConfig.from_hf_dict({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 6}).kv_window() == 6
    assert ModelConfig.from_hf_dict({**base, "architectures": ["MistralForCausalLM"]}).kv_window() is None
    gemma = {**base, "architectures": ["Gemma2ForCausalLM"], "sliding_window": 6, "head_dim": 16}
    assert ModelConfig.from_hf_dict(gemma).kv_window() is None  # global layers between the local ones


def test_the_simulator_frees_behind_a_window():
    from kvserve.sim.hardware import get_hardware
    from kvserve.sim.models import ModelSpec
    from kvserve.sim.profiles import get_profile
    from kvserve.sim.simulate import build_sim_engine

    d = dict(architectures=["MistralForCausalLM"], vocab_size=32000, hidden_size=4096, intermediate_size=14336,
             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, sliding_window=4096)
    spec = ModelSpec.from_hf_config(d, name="mistral")
    assert spec.sliding_window == 4096
    # 512 blocks of 16 tokens hold one sequence's window and chunk: the context is not capped by the pool
    engine, runner, _ = build_sim_engine(spec, get_hardware("h100-sxm"), get_profile("kvserve"), num_kv_blocks=512)
    assert engine.kv.sliding_window == 4096 and runner.max_model_len > 512 * 16
    engine.add_request("long", list(range(3, 3 + 20000)), SamplingParams(max_tokens=20, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        engine.kv.check()
        assert engine.kv.num_held("long") <= 512
    assert engine.scheduler.stats.num_generated_tokens == 20
    del d["sliding_window"]
    assert ModelSpec.from_hf_config(d).sliding_window is None
