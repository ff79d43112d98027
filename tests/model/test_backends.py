"""Attention backends and KV pools plug in through their registries, without touching the runner,
and the KV layout's byte counts are the same in the torch pool and the simulator."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch

from conftest import tiny_weights
from kvserve import SamplingParams
from kvserve.attention import (
    AttentionBackend,
    AttentionMetadata,
    KVPool,
    SeqRows,
    attention_backend_names,
    register_attention_backend,
    register_kv_pool,
)
from kvserve.errors import InvalidArgumentError
from kvserve.llm import LLM
from kvserve.model.config import ModelConfig
from kvserve.sim.models import ModelSpec

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@dataclass
class LoopMetadata(AttentionMetadata):
    # per sequence: first row, rows, the slots of its whole context, position of its first row
    seqs: list[tuple[int, int, torch.Tensor, int]] = field(default_factory=list)


class LoopBackend(AttentionBackend):
    """Reference attention: one sequence at a time, softmax(q k^T) v with an explicit causal mask.
    Reads the cache in whatever dtype the pool stores, computing in the model's."""

    def __init__(self, pool: KVPool, model_dtype: torch.dtype):
        super().__init__(pool, model_dtype)
        self.calls = 0

    def build_metadata(self, seqs: Sequence[SeqRows], num_decodes: int) -> LoopMetadata:
        bs, dev = self.pool.block_size, self.device
        slots: list[int] = []
        meta = LoopMetadata(torch.empty(0))
        row = 0
        for s in seqs:
            ctx = [s.block_table[p // bs] * bs + p % bs for p in range(s.end)]
            slots += ctx[s.start :]
            meta.seqs.append((row, len(s.tokens), torch.tensor(ctx, device=dev), s.start))
            row += len(s.tokens)
        meta.slot_mapping = torch.tensor(slots, device=dev)
        return meta

    def forward(self, q, k, v, layer_kv, meta: LoopMetadata):  # type: ignore[override]
        self.calls += 1
        k_cache, v_cache = layer_kv
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        rep = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for row, n, ctx, start in meta.seqs:
            kc = k_cache[ctx].to(q.dtype).repeat_interleave(rep, dim=1).transpose(0, 1)  # [heads, L, d]
            vc = v_cache[ctx].to(q.dtype).repeat_interleave(rep, dim=1).transpose(0, 1)
            scores = q[row : row + n].transpose(0, 1) @ kc.transpose(1, 2) / math.sqrt(q.shape[-1])  # [heads, n, L]
            causal = torch.arange(len(ctx), device=q.device)[None, :] <= torch.arange(start, start + n, device=q.device)[:, None]
            scores = scores.masked_fill(~causal, float("-inf"))
            out[row : row + n] = (torch.softmax(scores, dim=-1) @ vc).transpose(0, 1)
        return out


class Float16KVPool(KVPool):
    """K and V stored in float16, whatever the model runs in."""

    @classmethod
    def storage_dtype(cls, model_dtype: torch.dtype) -> torch.dtype:
        return torch.float16


register_attention_backend("test-loop", LoopBackend)
register_kv_pool("test-f16", Float16KVPool)

def tiny():
    return tiny_weights(kv_heads=2)


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 97) for _ in range(n)] for n in (1, 6, 17, 33)]


def make(**kw) -> LLM:
    cfg, w = tiny()
    return LLM.from_weights(cfg, w, dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=24, **kw)


def run(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts(), GREEDY)]


def test_a_registered_backend_runs_and_matches_the_default():
    want = run(make())
    llm = make(attention_backend="test-loop")
    assert run(llm) == want
    backend = llm.engine.runner.attention
    assert isinstance(backend, LoopBackend) and backend.calls > 0


def test_a_registered_kv_pool_stores_its_own_dtype_for_target_and_draft():
    want = run(make())
    cfg, w = tiny()
    llm = make(attention_backend="test-loop", kv_cache_dtype="test-f16", speculative_method="draft",
               speculative_model="in-memory", draft=(cfg, w))
    assert run(llm) == want
    runner = llm.engine.runner
    for pool in (runner.kv_pool, runner.proposer.kv_pool):
        assert type(pool) is Float16KVPool and pool.layers[0][0].dtype == torch.float16
    assert runner.block_bytes == make().engine.runner.block_bytes // 2


def test_unknown_names_and_mismatched_pools_are_refused_clearly():
    with pytest.raises(InvalidArgumentError, match="gather-sdpa") as e:
        make(attention_backend="nope")
    assert e.value.param == "attention_backend" and "gather-sdpa" in attention_backend_names()
    with pytest.raises(InvalidArgumentError, match="auto"):
        make(kv_cache_dtype="nope")
    with pytest.raises(InvalidArgumentError, match="gather-sdpa"):  # it reads the cache in the model's dtype
        make(kv_cache_dtype="test-f16")


@pytest.mark.parametrize("dtype, precision", [(torch.bfloat16, "bf16"), (torch.float32, "fp32"), (torch.float16, "fp16")])
def test_layout_bytes_agree_between_the_torch_pool_and_the_simulator(dtype, precision):
    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    spec = ModelSpec("tiny", hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=97)
    pool = KVPool(KVPool.layout_for(cfg, dtype, 8), num_blocks=5, device=torch.device("cpu"))
    stored = sum(t[: pool.null_slot].nbytes for kv in pool.layers for t in kv)  # the pool's blocks, not the null one
    assert stored == 5 * pool.block_bytes
    assert pool.layout.bytes_per_token == spec.kv_bytes_per_token(precision) == 2 * 3 * 2 * 16 * dtype.itemsize
    assert pool.block_bytes == spec.kv_layout(precision, 8).block_bytes
    payload = torch.randn(pool.block_bytes // dtype.itemsize).to(dtype).view(torch.uint8).numpy().tobytes()
    pool.write_block(3, payload)
    assert pool.read_block(3) == payload
