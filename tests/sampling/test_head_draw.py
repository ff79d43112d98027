"""The engine's draw inside the LM head (``CausalLM.draw_in_head``, kernels/csrc/sampling/amx_head.cpp):
on an AMX CPU, a quantized LM head draws a step's tokens without logits when every row is greedy or
plain temperature (16+ rows, those its bf16 copy takes): greedy output as the logits path gives it,
seeded draws that do not depend on the batch, and the logits path kept for what needs logits."""

from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from kvserve.kernels import load_kernels

    if not load_kernels() or not torch.ops.kvserve.amx_gemm_available():
        pytest.skip("no AMX-BF16 tiles on this CPU (or no native kernels)")
    from kvserve.llm import LLM

    # no prefix cache: a later run must prefill as the first did (rows past AMX_MIN_ROWS on the same kernels)
    llm = LLM(str(tiny_model_dir), dtype="float32", quantization="int8", num_kv_blocks=512, block_size=4,
              max_num_seqs=32, max_num_batched_tokens=512, enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert model.lm_head.draw_tiles is not None
    return llm


def _prompts(n: int) -> list[list[int]]:
    return [[5 + 7 * i + j for j in range(6 + i % 5)] for i in range(n)]


def _run(llm, monkeypatch, prompts, params, fused: bool) -> tuple[list[list[int]], int]:
    """Tokens of each prompt, and how many steps drew in the head. Unfused, the logits come from the
    head's tile copy through amx_linear: the same sums as the draw's, so the two paths' tokens compare
    exactly (oneDNN's bf16 logits of the same weights round some near-ties the other way)."""
    model = llm.engine.runner.model
    calls = []
    draw = model.draw_in_head
    with monkeypatch.context() as m:
        m.setattr(model, "draw_in_head", lambda *a: calls.append(a[0].shape[0]) or draw(*a))
        if not fused:
            head = model.lm_head

            def tile_logits(hidden, keep_bf16=False):
                out = torch.ops.kvserve.amx_linear(hidden.bfloat16().contiguous(), head.draw_tiles, head.out_features)
                return out if keep_bf16 else out.float()

            m.setattr(model, "draws_in_head", lambda *a: False)
            m.setattr(model, "logits", tile_logits)
        outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], len(calls)


def test_greedy_steps_draw_in_the_head_and_give_the_logits_paths_tokens(llm, monkeypatch):
    prompts, params = _prompts(20), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    fused, steps = _run(llm, monkeypatch, prompts, params, fused=True)
    unfused, none = _run(llm, monkeypatch, prompts, params, fused=False)
    assert steps >= 5 and none == 0
    assert fused == unfused


def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_steps(llm, monkeypatch):
    """Its uniform numbers come from its own generator and its row's draw reads only its row."""
    seeded = SamplingParams(max_tokens=6, temperature=0.9, seed=1234, ignore_eos=True)
    prompts = _prompts(20)
    alone_ish, steps = _run(llm, monkeypatch, prompts, [seeded] + [SamplingParams(max_tokens=6, temperature=0.0,
                                                                                   ignore_eos=True)] * 19, fused=True)
    others = [SamplingParams(max_tokens=6, temperature=1.3, ignore_eos=True)] * 19
    mixed, steps2 = _run(llm, monkeypatch, prompts, [seeded] + others, fused=True)
    assert steps >= 5 and steps2 >= 5
    assert alone_ish[0] == mixed[0]
    assert mixed[1:] != alone_ish[1:]  # the others did sample


def test_rows_that_need_logits_keep_the_logits_path(llm, monkeypatch):
    prompts = _prompts(20)
    for odd in (SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, ignore_eos=True),
                SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
                SamplingParams(max_tokens=4, temperature=1.0, top_k=5, ignore_eos=True)):
        params = [odd] + [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)] * 19
        _, steps = _run(llm, monkeypatch, prompts, params, fused=True)
        assert steps == 0, odd
    few = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert _run(llm, monkeypatch, prompts[:8], few, fused=True)[1] == 0  # under AMX_MIN_ROWS rows: no bf16 head


def test_the_head_draws_where_it_measured_faster(llm):
    """AMX_MIN_ROWS (the head's bf16 copy) to HEAD_DRAW_MAX_ROWS rows: past that the separate head and
    draw measured faster."""
    from kvserve.model.quant_linear import AMX_MIN_ROWS, HEAD_DRAW_MAX_ROWS

    model = llm.engine.runner.model
    rows = lambda n: torch.zeros(n, model.lm_head.in_features)  # noqa: E731
    assert not model.draws_in_head(rows(AMX_MIN_ROWS - 1))
    assert model.draws_in_head(rows(AMX_MIN_ROWS))
    assert model.draws_in_head(rows(HEAD_DRAW_MAX_ROWS))
    assert not model.draws_in_head(rows(HEAD_DRAW_MAX_ROWS + 1))


def test_the_step_split_times_the_draw_in_the_head_as_its_own_part(tiny_model_dir):
    from kvserve.bench.step_split import StepTimer
    from kvserve.kernels import load_kernels
    from kvserve.llm import LLM

    if not load_kernels() or not torch.ops.kvserve.amx_gemm_available():
        pytest.skip("no AMX-BF16 tiles on this CPU (or no native kernels)")
    llm = LLM(str(tiny_model_dir), dtype="float32", quantization="int8", num_kv_blocks=256, block_size=4, max_num_seqs=32)
    timer = StepTimer(llm.engine.runner, batch=20)
    llm.generate(_prompts(20), SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True))
    assert timer.steps and all(s["head_draw"] > 0 and s["sampling"] == 0 for s in timer.steps)


def test_with_drafts_verifying_steps_take_the_logits_and_the_rest_draw_in_the_head(tiny_model_dir, monkeypatch):
    """Speculative decoding: drafts are proposed after steps the head drew; steps that verify drafts
    take the logits path. The proposer here drafts every other step (the sequence's last token), so
    both kinds of step run; every request still gets all its tokens."""
    from kvserve.kernels import load_kernels
    from kvserve.llm import LLM
    from kvserve.spec.proposer import Draft

    if not load_kernels() or not torch.ops.kvserve.amx_gemm_available():
        pytest.skip("no AMX-BF16 tiles on this CPU (or no native kernels)")
    llm = LLM(str(tiny_model_dir), dtype="float32", quantization="int8", num_kv_blocks=512, block_size=4,
              max_num_seqs=32, speculative_method="ngram", adaptive_speculation=False, enable_prefix_caching=False)
    runner = llm.engine.runner
    calls = {"propose": 0, "logits": 0}

    def propose(batch):
        calls["propose"] += 1
        return {} if calls["propose"] % 2 else {d.request.request_id: Draft(d.token_ids[-1:] * 2) for d in batch}

    monkeypatch.setattr(runner.proposer, "propose", propose)
    logits = runner.model.logits

    def counted_logits(*a, **k):
        calls["logits"] += 1
        return logits(*a, **k)

    monkeypatch.setattr(runner.model, "logits", counted_logits)
    tokens, drew = _run(llm, monkeypatch, _prompts(20), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                        fused=True)
    assert all(len(t) == 12 for t in tokens)
    assert drew >= 1 and calls["logits"] >= 1
