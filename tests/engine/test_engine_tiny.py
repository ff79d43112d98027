"""The engine on tiny random Llama models: batching, chunking and paging never change outputs."""

import random

import pytest
import torch

from conftest import hf_greedy, hf_weights, kvserve_config, tiny_hf_model
from kvserve import SamplingParams
from kvserve.llm import LLM

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPT_LENS = [1, 5, 16, 17, 33, 40]


def prompts(vocab=97, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


MODELS = {
    "gqa-untied": dict(kv_heads=2, tie=False),
    "mha-tied": dict(kv_heads=4, tie=True),
    "mqa-untied": dict(kv_heads=1, tie=False),
    "qwen2-bias": dict(kv_heads=2, bias=True),
    "llama3-rope": dict(kv_heads=2, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
}


_cache: dict[str, tuple] = {}


def build(name):
    if name not in _cache:
        hf = tiny_hf_model(**MODELS[name])
        _cache[name] = (hf, kvserve_config(hf), hf_weights(hf))
    return _cache[name]


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return build(request.param)


# the chunk x block-size grid runs on the two shapes the issue names: with GQA, and tied MHA
@pytest.fixture(scope="module", params=["gqa-untied", "mha-tied"])
def grid_model(request):
    return build(request.param)


_expected: dict[int, list[list[int]]] = {}


def expected_alone(model) -> list[list[int]]:
    """Each prompt run by itself, with the whole prompt in one chunk."""
    if id(model) not in _expected:
        alone = make_llm(model, block_size=16, max_num_batched_tokens=512)
        _expected[id(model)] = [alone.generate([p], GREEDY)[0].token_ids for p in prompts()]
    return _expected[id(model)]


def make_llm(model, **kw):
    _, cfg, w = model
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_kv_blocks", 256)
    return LLM.from_weights(cfg, w, **kw)


def test_matches_transformers_greedy(model):
    hf = model[0]
    llm = make_llm(model, block_size=4, max_num_batched_tokens=16)
    ps = prompts()
    outs = llm.generate(ps, GREEDY)
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(hf, p, 10)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("budget", [1, 7, 16, 100])
def test_batch_equals_alone(grid_model, block_size, budget):
    llm = make_llm(grid_model, block_size=block_size, max_num_batched_tokens=budget)
    got = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
    assert got == expected_alone(grid_model)
    assert llm.engine.kv.num_available_blocks == llm.engine.kv.pool.num_blocks


@pytest.mark.parametrize("block_size", [1, 16])
def test_preemption_under_tiny_pool_keeps_outputs(grid_model, block_size):
    model = grid_model
    ps = prompts()
    expected = expected_alone(model)
    # room for about two sequences at a time: later arrivals keep being preempted and recomputed
    blocks = 2 * (max(PROMPT_LENS) + 10) // block_size + 2
    llm = make_llm(model, block_size=block_size, num_kv_blocks=blocks, max_num_batched_tokens=32)
    got = [o.token_ids for o in llm.generate(ps, GREEDY)]
    assert got == expected
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert llm.engine.kv.num_available_blocks == blocks


def test_abort_mid_flight_frees_every_block(grid_model):
    model = grid_model
    llm = make_llm(model, block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    eng = llm.engine
    for i, p in enumerate(prompts()):
        eng.add_request(str(i), p, SamplingParams(max_tokens=50, ignore_eos=True, temperature=0))
    for _ in range(6):
        eng.step()
    assert eng.kv.num_free_blocks < 64
    for i in range(0, len(PROMPT_LENS), 2):
        eng.abort(str(i))
    while eng.has_unfinished():
        eng.step()
    assert eng.kv.num_available_blocks == 64 and not eng.kv.tables


def test_sampling_seeded_reproducible_whatever_the_batch(grid_model):
    model = grid_model
    ps = prompts()
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = make_llm(model).generate([ps[2]], seeded)[0].token_ids
    crowd = [SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True) for _ in ps]
    crowd[2] = seeded
    in_batch = make_llm(model, max_num_batched_tokens=7).generate(ps, crowd)[2].token_ids
    assert alone == in_batch
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    assert make_llm(model).generate([ps[2]], other_seed)[0].token_ids != alone


def test_top_k_1_is_greedy(grid_model):
    model = grid_model
    ps = prompts()
    llm = make_llm(model)
    greedy = [o.token_ids for o in llm.generate(ps, GREEDY)]
    topk = SamplingParams(max_tokens=10, temperature=1.5, top_k=1, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(ps, topk)] == greedy


def test_logprobs_of_greedy_token_are_the_max(grid_model):
    model = grid_model
    llm = make_llm(model)
    out = llm.generate([prompts()[3]], SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok
        assert lp.top[0][0] == tok and abs(lp.top[0][1] - lp.logprob) < 1e-6
        assert lp.logprob <= 0 and len(lp.top) == 3


def test_max_model_len_caps_generation(grid_model):
    model = grid_model
    llm = make_llm(model, max_model_len=20)
    out = llm.generate([[5] * 15], SamplingParams(max_tokens=100, ignore_eos=True, temperature=0))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="context window"):
        llm.generate([[5] * 20], GREEDY)


def test_time_capped_prefill_keeps_outputs(grid_model):
    from kvserve.engine.step_cost import StepFeatures

    llm = make_llm(grid_model, block_size=4, max_num_batched_tokens=64, prefill_step_factor=1.5,
                   metered_prefill_min_tokens=0)  # meter even these short prompts
    sched = llm.engine.scheduler
    sched.observe_step = lambda batch, seconds: None  # a fixed cost model, so the test does not depend on timing
    for p, d in [(0, 4), (0, 8), (16, 0), (64, 4), (256, 0), (0, 2), (32, 8), (128, 2), (0, 6), (8, 1), (512, 0), (0, 3)]:
        sched.cost.observe(StepFeatures(p, d, 0.0), 0.010 + 0.001 * d + 0.001 * p)
    assert sched.cost.ready
    llm.engine.stats.keep_steps = True
    got = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
    assert got == expected_alone(grid_model)
    uncapped = make_llm(grid_model, block_size=4, max_num_batched_tokens=64, prefill_step_factor=0)
    uncapped.engine.stats.keep_steps = True
    uncapped.generate(prompts(), GREEDY)
    # smaller prefill chunks beside decodes: the same work takes more steps
    assert len(llm.engine.stats.steps) > len(uncapped.engine.stats.steps)


def test_decodes_of_very_different_lengths_are_grouped_and_exact(grid_model, monkeypatch):
    """A long sequence decoding beside short ones gets its own attention group (the short ones do
    not gather padding up to its length), and every output still equals the prompt run alone.
    (The gather-sdpa backend's grouping: the paged backend reads contexts in place.)"""
    from kvserve.attention import sdpa
    from kvserve.runner import inputs, torch_runner

    rng = random.Random(5)
    ps = [[rng.randrange(3, 97) for _ in range(n)] for n in (10, 12, 400, 9)]
    alone = make_llm(grid_model, block_size=16, max_num_batched_tokens=512)
    want = [alone.generate([p], GREEDY)[0].token_ids for p in ps]
    llm = make_llm(grid_model, block_size=4, max_num_batched_tokens=512, attention_backend="gather-sdpa")
    groups = []

    def spy(*args):
        out = inputs.build_inputs(*args)
        groups.append(len(out.meta.decode_groups))
        return out

    monkeypatch.setattr(torch_runner, "build_inputs", spy)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == want
    assert max(groups) == 2
    ends = sdpa._decode_group_ends
    assert ends([]) == []


def test_packed_linear_hands_onednn_few_row_counts():
    """oneDNN compiles and keeps a kernel per input shape (~1 MiB each): a PackedLinear pads the
    rows to a few sizes, else the engine's memory grew with every new step size (found by the
    soak, scripts/soak.py). The outputs are those of F.linear."""
    from kvserve.model.layers import PackedLinear, cpu_packing_supported, padded_rows

    counts = range(1, 8193)
    assert all(m <= padded_rows(m) <= 1.125 * m for m in counts)
    assert all(padded_rows(m) == m for m in range(1, 17))  # small decode batches: exact
    assert len({padded_rows(m) for m in counts}) <= 16 + 8 * 9  # 8 per octave up to 8192
    if not cpu_packing_supported(torch.float32):
        pytest.skip("no oneDNN here")
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(24, 8, generator=g), torch.randn(24, generator=g)
    lin = PackedLinear(w, b)
    with torch.inference_mode():
        for m in (1, 16, 17, 33, 100, 513):
            x = torch.randn(m, 8, generator=g)
            out = lin(x)
            assert out.shape == (m, 24) and out.is_contiguous()
            torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b))
