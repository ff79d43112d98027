"""The feature matrix's features with an 8-bit KV cache (fp8, int8): prefix cache, small chunks,
host and disk tiers, preemption, speculation, structured output, the native decode stack.

An 8-bit pool's scales are fixed at start-up and a fresh prompt attends over its own K/V as they
are stored, so a token's output never depends on how its context reached the cache: every cell's
greedy outputs equal the same KV dtype's plain run (constrained requests: with the constraint),
block accounting is exact after every step, and every block comes back.
"""

from __future__ import annotations

import json

import pytest

from conftest import check_every_step
from kvserve import SamplingParams
from kvserve.structured import GuidedSpec

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4}
PROMPTS = [[100 + i, 200 + i, 300, 301, 302, 100 + i, 200 + i, 300] + [400 + j for j in range(3 * i)] for i in range(6)]
CELLS = {
    "small-chunks": dict(max_num_batched_tokens=8),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "ngram": dict(speculative_method="ngram", ngram_min=1, adaptive_speculation=False),
    "tight-pool-host-tier": dict(num_kv_blocks=24, kv_offload_memory_gb=0.05),  # preempts, offloads, restores
    "paged": dict(attention_backend="paged"),
    "gather-sdpa": dict(attention_backend="gather-sdpa"),
}


def _params(structured: bool) -> list[SamplingParams]:
    guided = [GuidedSpec.json_schema(SCHEMA) if structured and i % 2 == 0 else None for i in range(len(PROMPTS))]
    return [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=g is None, guided=g) for g in guided]


def _llm(tiny_model_dir, kv: str, **extra):
    from kvserve.llm import LLM

    args = dict(dtype="float32", block_size=4, num_kv_blocks=1024, kv_cache_dtype=kv) | extra
    return LLM(str(tiny_model_dir), **args)


def _run(llm, structured: bool = False) -> list[list[int]]:
    check_every_step(llm)
    outs = llm.generate(PROMPTS, _params(structured))
    for i, o in enumerate(outs):
        assert o.finish_reason in ("stop", "length")
        if structured and i % 2 == 0 and o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), SCHEMA)
    eng = llm.engine
    eng.step()  # hands the finished ids to the runner
    assert eng.kv.pool.num_free + eng.kv.pool.num_evictable == eng.kv.pool.num_blocks and not eng.kv.tables
    return [o.token_ids for o in outs]


_baselines: dict[tuple[str, bool], list] = {}


def _baseline(tiny_model_dir, kv: str, structured: bool) -> list:
    if (kv, structured) not in _baselines:
        _baselines[kv, structured] = _run(_llm(tiny_model_dir, kv), structured)
    return _baselines[kv, structured]


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_cell_equals_the_plain_run(tiny_model_dir, kv, cell):
    if cell == "paged":
        from kvserve.kernels import load_kernels

        if not load_kernels():
            pytest.skip("native kernels did not build")
    llm = _llm(tiny_model_dir, kv, **CELLS[cell])
    assert llm.engine.runner.kv_pool.quantized
    assert _run(llm) == _baseline(tiny_model_dir, kv, False)
    if cell == "tight-pool-host-tier":
        assert llm.engine.scheduler.stats.num_preemptions > 0


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_structured_output(tiny_model_dir, kv):
    assert _run(_llm(tiny_model_dir, kv, max_num_batched_tokens=8), structured=True) == _baseline(tiny_model_dir, kv, True)


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_blocks_restored_from_the_host_and_disk_tiers(tiny_model_dir, tmp_path, kv):
    """Evicted blocks come back from the tiers (their payloads carry the scales) and the outputs
    equal those of prefilling again; a second engine on the same disk directory reads them too."""
    want = _baseline(tiny_model_dir, kv, False)
    tiers = dict(num_kv_blocks=24, kv_offload_memory_gb=0.05, kv_offload_dir=str(tmp_path))
    llm = _llm(tiny_model_dir, kv, **tiers)
    assert _run(llm) == want
    assert _run(llm) == want  # the same prompts again: their prefixes come back from the tiers
    assert sum(llm.engine.kv.stats.tier_hits.values()) > 0
    fresh = _llm(tiny_model_dir, kv, num_kv_blocks=24, kv_offload_dir=str(tmp_path))
    assert _run(fresh) == want
    assert fresh.engine.kv.stats.tier_hits.get("disk", 0) > 0


def test_an_fp8_block_is_never_read_by_an_int8_engine(tiny_model_dir, tmp_path):
    fp8 = _llm(tiny_model_dir, "fp8", num_kv_blocks=24, kv_offload_dir=str(tmp_path))
    _run(fp8)
    assert any(tmp_path.iterdir())  # fp8 blocks on disk
    other = _llm(tiny_model_dir, "int8", kv_offload_dir=str(tmp_path))  # an ample pool: it evicts nothing itself
    assert other.engine.runner.kv_fingerprint != fp8.engine.runner.kv_fingerprint
    assert _run(other) == _baseline(tiny_model_dir, "int8", False)
    assert not other.engine.kv.stats.tier_hits.get("disk", 0)
