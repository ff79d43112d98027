"""Every feature with every other: prefix cache × chunk budget × speculation × structured output ×
KV offload × pool size × sampling, with concurrent requests in each cell (issue 9's matrix).

Each cell: every request completes; greedy outputs equal the plain baseline (free requests the
all-off run, constrained ones the all-off run with the same constraint); JSON outputs validate;
block accounting is exact after every step and every block comes back. A combination that cannot
work must be refused at start-up with a clear message (the host tier needs the prefix cache).
"""

from __future__ import annotations

import itertools
import json

import pytest

from conftest import check_every_step
from kvserve import SamplingParams
from kvserve.errors import InvalidArgumentError
from kvserve.structured import GuidedSpec

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4}
PROMPTS = [[100 + i, 200 + i, 300, 301, 302, 100 + i, 200 + i, 300] + [400 + j for j in range(3 * i)] for i in range(6)]
AXES = {
    "prefix_cache": [True, False],
    "chunk_budget": [8, 512],
    "speculation": [None, "ngram"],
    "structured": [False, True],
    "offload": [False, True],
    "pool": ["ample", "tight"],
    "sampling": ["greedy", "seeded"],
}
CELLS = [dict(zip(AXES, values)) for values in itertools.product(*AXES.values())]


def params(cell: dict, i: int) -> SamplingParams:
    guided = GuidedSpec.json_schema(SCHEMA) if cell["structured"] and i % 2 == 0 else None
    if cell["sampling"] == "greedy":
        return SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=guided is None, guided=guided)
    return SamplingParams(max_tokens=20, temperature=1.0, seed=i, ignore_eos=guided is None, guided=guided)


def engine_args(cell: dict) -> dict:
    args = dict(dtype="float32", block_size=4, max_num_batched_tokens=cell["chunk_budget"],
                enable_prefix_caching=cell["prefix_cache"],
                num_kv_blocks=1024 if cell["pool"] == "ample" else 24)  # tight: ~2 of the 6 sequences
    if cell["speculation"]:
        args.update(speculative_method="ngram", ngram_min=1, adaptive_speculation=False)
    if cell["offload"]:
        args["kv_offload_memory_gb"] = 0.05
    return args


_baselines: dict[bool, list] = {}


def baseline(tiny_model_dir, structured: bool) -> list:
    from kvserve.llm import LLM

    if structured not in _baselines:
        llm = LLM(str(tiny_model_dir), dtype="float32", block_size=4, num_kv_blocks=1024)
        cell = {"structured": structured, "sampling": "greedy"}
        _baselines[structured] = llm.generate(PROMPTS, [params(cell, i) for i in range(len(PROMPTS))])
    return _baselines[structured]


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_cell(tiny_model_dir, cell):
    from kvserve.llm import LLM

    if cell["offload"] and not cell["prefix_cache"]:
        with pytest.raises(InvalidArgumentError, match="prefix caching"):
            LLM(str(tiny_model_dir), **engine_args(cell))
        return
    llm = LLM(str(tiny_model_dir), **engine_args(cell))
    eng = llm.engine
    check_every_step(llm)
    outs = llm.generate(PROMPTS, [params(cell, i) for i in range(len(PROMPTS))])
    for i, o in enumerate(outs):
        assert o.finish_reason in ("stop", "length")
        if o.finish_reason == "length":
            assert len(o.token_ids) == 20
        if cell["structured"] and i % 2 == 0 and o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), SCHEMA)
    if cell["sampling"] == "greedy":
        want = baseline(tiny_model_dir, cell["structured"])
        assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    if cell["pool"] == "tight":
        assert eng.scheduler.stats.num_preemptions > 0
    eng.step()  # hands the finished ids to the runner
    pool = eng.kv.pool
    assert pool.num_free + pool.num_evictable == pool.num_blocks and not eng.kv.tables
