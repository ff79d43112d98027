"""A tiny random Mistral whose window is shorter than its prompts, generating past several windows, with
the KV manager freeing the blocks behind the window: greedy tokens equal transformers' ``generate`` (float32,
``--quantization none``), every sequence holds no more than its window's blocks (and its chunk's), and the
block accounting is exact after every step; with chunked prefill, prefix-cache hits, preemption in a small
pool, and speculative verify rows. And the paged backend's cascade grouping never takes placeholders for
shared blocks."""

from __future__ import annotations

import logging
import math
import random

import pytest
import torch

from conftest import hf_greedy, hf_weights, kvserve_config
from kvserve import SamplingParams
from kvserve.kv.block_pool import NO_BLOCK
from kvserve.llm import LLM

W, BS = 8, 2
PROMPT_LENS = [11, 20, 27]
GREEDY = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True)  # past several windows


@pytest.fixture(scope="module")
def mistral():
    import transformers

    cfg = transformers.MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     max_position_embeddings=512, sliding_window=W, bos_token_id=1, eos_token_id=2,
                                     pad_token_id=0, tie_word_embeddings=False)
    cfg.architectures = ["MistralForCausalLM"]
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            else:
                p.add_(torch.randn_like(p) * 0.2)
    model.eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 97) for _ in range(n)] for n in PROMPT_LENS]
    want = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    return kvserve_config(model), hf_weights(model), prompts, want


class Watch:
    """Wraps an LLM's engine: after every step the accounting is exact (``KVManager.check``); after
    every schedule each sequence holds at most the window of its chunk's first row plus the chunk's
    rows, and no entry it reads is a placeholder. ``peak_decode``: the most blocks a decode held."""

    def __init__(self, llm: LLM):
        self.peak_decode = 0
        self.freed = 0
        engine, kv, sched = llm.engine, llm.engine.kv, llm.engine.scheduler
        schedule, step = sched.schedule, engine.step

        def watched_schedule():
            batch = schedule()
            for c in batch.chunks:
                held = kv.num_held(c.request.request_id)
                assert held <= math.ceil((W - 1 + c.num_tokens) / BS) + 1, (held, c.start, c.num_tokens)
                assert NO_BLOCK not in c.block_table[max(0, c.start - W + 1) // BS:]
                self.freed = max(self.freed, c.block_table.count(NO_BLOCK))
                if c.num_tokens == 1:
                    self.peak_decode = max(self.peak_decode, held)
            return batch

        def checked_step():
            out = step()
            kv.check()
            return out

        sched.schedule, engine.step = watched_schedule, checked_step


def make(mistral, **kw) -> tuple[LLM, Watch]:
    cfg, w, _, _ = mistral
    kw.setdefault("num_kv_blocks", 256)
    llm = LLM.from_weights(cfg, w, dtype="float32", quantization="none", block_size=BS, **kw)
    assert llm.engine.kv.sliding_window == W
    return llm, Watch(llm)


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("torch_path", [False, True], ids=["native", "torch"])
def test_greedy_equals_transformers_and_blocks_stay_bounded(mistral, torch_path):
    _, _, prompts, want = mistral
    kw = dict(attention_backend="gather-sdpa") if torch_path else {}
    llm, watch = make(mistral, max_num_batched_tokens=512, **kw)
    if torch_path:
        llm.engine.runner.model.use_native_ops(False)
    assert generate(llm, prompts) == want
    assert watch.peak_decode <= math.ceil(W / BS) + 1
    assert watch.freed >= (max(PROMPT_LENS) + GREEDY.max_tokens - W) // BS - 1  # it did let go of the early blocks
    assert llm.engine.kv.num_available_blocks == llm.engine.kv.pool.num_blocks


def test_chunked_prefill_and_prefix_hits(mistral):
    _, _, prompts, want = mistral
    llm, watch = make(mistral, max_num_batched_tokens=3)
    assert generate(llm, prompts) == want
    hits = llm.engine.kv.stats.device_hits
    assert generate(llm, prompts) == want  # every prompt a hit on blocks the first run let go of
    assert llm.engine.kv.stats.device_hits >= hits + sum(n - 1 - (n - 1) % BS for n in PROMPT_LENS)
    assert watch.peak_decode <= math.ceil(W / BS) + 1


def test_preemption_in_a_small_pool(mistral, caplog):
    _, _, prompts, want = mistral
    # about two windows and chunks: the three sequences' whole contexts (~80 blocks) are far beyond it
    with caplog.at_level(logging.INFO, logger="kvserve.build"):
        llm, watch = make(mistral, max_num_batched_tokens=4, num_kv_blocks=12)
    assert "sliding window of 8 tokens on every layer" in caplog.text  # the start-up log says so
    assert llm.engine.max_model_len > 12 * BS  # the pool holds one sequence's window: no cap on its length
    assert generate(llm, prompts) == want
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert llm.engine.kv.num_available_blocks == llm.engine.kv.pool.num_blocks


def test_speculative_verify_rows(mistral):
    cfg, w, prompts, want = mistral
    llm, watch = make(mistral, max_num_batched_tokens=64, speculative_method="draft", speculative_model="in-memory",
                      draft=(cfg, w), num_speculative_tokens=3, adaptive_speculation=False)
    assert generate(llm, prompts) == want
    assert llm.engine.scheduler.stats.spec.num_accepted_tokens > 0
    assert watch.peak_decode <= math.ceil(W / BS) + 1


def test_paged_metadata_groups_no_chunks_on_placeholders():
    """Two long chunks whose tables a window emptied at the front share no cached prefix: the paged
    backend's cascade grouping must not take their matching NO_BLOCK entries for shared blocks."""
    from kvserve.attention import KVPool, SeqRows
    from kvserve.attention.paged import PagedBackend
    from kvserve.kernels import load_kernels
    from kvserve.kv.layout import KVLayout

    if not load_kernels():
        pytest.skip("native kernels did not build")
    bs = 16
    pool = KVPool(KVLayout(1, 2, 16, bs, "float32"), 64, torch.device("cpu"))
    backend = PagedBackend(pool, torch.float32)
    tables = [[NO_BLOCK] * 12 + list(range(i * 20, i * 20 + 10)) for i in range(2)]
    seqs = [SeqRows([5] * 129, 200, t) for t in tables]
    meta = backend.build_metadata(seqs, 0)
    assert len(meta.gathered) == 2 and all(g.prefix == 0 for g in meta.gathered)
