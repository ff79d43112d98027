"""Mamba-2 layers (kvserve.model.mamba): the recurrence against transformers' scan, prompts longer than a block, state
slots from the KV manager (handed out, reused, given back on preemption), and what such a model refuses."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import hf_greedy
from kvserve import SamplingParams
from kvserve.errors import InvalidArgumentError
from kvserve.kv.manager import KVManager
from kvserve.model.config import ModelConfig
from kvserve.model.mamba import BLOCK, Mamba2
from test_architectures import GREEDY, checkpoint, make_llm, prompts

CASE = "GraniteMoeHybridForCausalLM:mamba"


def mixer(dt_limit=(0.0, float("inf"))) -> Mamba2:
    cfg = ModelConfig(vocab_size=10, hidden_size=32, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2,
                      mamba_layers=[True], mamba_heads=4, mamba_head_dim=16, mamba_groups=2, mamba_state_size=8,
                      mamba_dt_limit=dt_limit)
    torch.manual_seed(0)
    m = Mamba2(cfg, 0)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    return m


@pytest.mark.parametrize("length", [1, 7, BLOCK, 2 * BLOCK + 22])
def test_the_recurrence_equals_transformers_scan(length):
    """Blocks of BLOCK tokens with the state carried between them, and one token (the decode step), from a state:
    transformers' reference scan (its own chunks of 16), step sizes clamped to the limit."""
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_chunk_scan

    m = mixer(dt_limit=(0.05, 2.0))
    torch.manual_seed(1)
    u = torch.randn(2, length, m.conv_dim)
    dt = torch.randn(2, length, m.heads)
    h0 = torch.randn(2, m.heads, m.head_dim, m.state_size)
    y, h = m.recurrence(u, dt, h0.clone())
    x, b, c = u.split([m.inner, m.groups * m.state_size, m.groups * m.state_size], dim=-1)
    want, want_h = mamba2_chunk_scan(
        x.reshape(2, length, m.heads, m.head_dim), dt, -torch.exp(m.A_log.detach()),
        b.reshape(2, length, m.groups, m.state_size), c.reshape(2, length, m.groups, m.state_size), chunk_size=16,
        D=m.D.detach(), dt_bias=m.dt_bias.detach(), initial_states=h0, dt_softplus=True, dt_limit=m.dt_limit,
        return_final_states=True)
    torch.testing.assert_close(y, want.flatten(2), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(h, want_h, atol=1e-4, rtol=1e-4)


def test_a_chunked_prompt_equals_the_whole_one():
    """The convolution's and the recurrence's states carried across chunks: the outputs of a prompt in three pieces
    (one shorter than the kernel) are those of the whole prompt."""
    m = mixer()
    torch.manual_seed(2)
    u = torch.randn(1, 90, m.conv_dim)
    dt = torch.randn(1, 90, m.heads)
    h = torch.zeros(1, m.heads, m.head_dim, m.state_size)
    conv = torch.zeros(1, m.taps - 1, m.conv_dim)
    whole, _ = m.recurrence(m.convolve(u, conv)[0], dt, h)
    parts = []
    for a, b in ((0, 2), (2, 70), (70, 90)):
        out, conv = m.convolve(u[:, a:b], conv)
        y, h = m.recurrence(out, dt[:, a:b], h)
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts, 1), whole, atol=1e-5, rtol=1e-5)


def test_a_prompt_longer_than_a_block_equals_transformers(tmp_path_factory):
    """150 tokens in chunks of 50 (crossing BLOCK inside chunks), then decode: transformers' greedy tokens."""
    model, folder = checkpoint(CASE, tmp_path_factory)
    rng = random.Random(5)
    long = [[rng.randrange(3, 97) for _ in range(150)], [rng.randrange(3, 97) for _ in range(70)]]
    want = [hf_greedy(model, p, 6) for p in long]
    llm = make_llm(folder, max_num_batched_tokens=50)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(long, params)] == want


def test_fewer_state_slots_than_requests_reuse_them(tmp_path_factory):
    """--max-num-seqs 2: five prompts run two at a time; a slot a finished sequence gave back starts the next one from
    zeros. Every slot is free at the end."""
    from test_architectures import expected

    _, folder = checkpoint(CASE, tmp_path_factory)
    llm = make_llm(folder, max_num_seqs=2)
    assert llm.engine.kv.state_slots == 2
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == expected(CASE, tmp_path_factory)
    assert not llm.engine.kv.states and sorted(llm.engine.kv._free_states) == [0, 1]


def test_the_kv_manager_hands_out_state_slots():
    kv = KVManager(16, 4, enable_prefix_caching=False, state_slots=2)
    assert kv.state_slot("a") == -1
    kv.grow("a", 5)
    kv.grow("b", 3)
    assert {kv.state_slot("a"), kv.state_slot("b")} == {0, 1}
    assert not kv.can_grow("c", 1)  # blocks to spare, but no slot
    kv.grow("a", 9)  # growing keeps the slot
    slot = kv.state_slot("b")
    kv.free("b")  # finished or preempted
    assert kv.can_grow("c", 1)
    kv.grow("c", 1)
    assert kv.state_slot("c") == slot
    kv.check()
    with pytest.raises(ValueError, match="prefix cache"):
        KVManager(16, 4, state_slots=2)


@pytest.mark.parametrize("args, what", [
    (dict(speculative_method="ngram", num_speculative_tokens=2), "speculative decoding"),
    (dict(kv_offload_memory_gb=0.01), "KV offload tiers")])
def test_what_a_recurrent_state_rules_out_is_refused_in_one_line(args, what, tmp_path_factory):
    _, folder = checkpoint(CASE, tmp_path_factory)
    with pytest.raises(InvalidArgumentError, match=what) as e:
        make_llm(folder, **args)
    assert "\n" not in str(e.value)


def test_prefix_caching_is_turned_off_and_the_log_says_so(tmp_path_factory, caplog):
    import logging

    _, folder = checkpoint(CASE, tmp_path_factory)
    with caplog.at_level(logging.INFO):
        llm = make_llm(folder)
    assert llm.engine.kv.cache is None
    assert "prefix caching off" in caplog.text and "recurrent state: " in caplog.text


def test_a_model_without_attention_sizes_its_blocks_by_position(tmp_path_factory):
    """Mamba2: no layer keeps KV, so blocks cost nothing and the default pool maps every sequence's whole context."""
    from kvserve import LLM
    from kvserve.model.loader import load_model
    from test_architectures import expected

    _, folder = checkpoint("Mamba2ForCausalLM", tmp_path_factory)
    loaded = load_model(folder)
    loaded.config.eos_token_ids = []
    llm = LLM.from_weights(loaded.config, loaded.weights, dtype="float32", quantization="none", max_num_seqs=4)
    assert llm.engine.runner.kv_pool.block_bytes == 0
    assert llm.engine.runner.num_kv_blocks * llm.engine.runner.block_size >= 4 * llm.engine.max_model_len
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == expected("Mamba2ForCausalLM", tmp_path_factory)


def test_state_slots_are_capped_by_memory(tmp_path_factory, monkeypatch, caplog):
    """Where --max-num-seqs states would not fit the memory cap, fewer slots: the log says so, and requests beyond
    them wait for a slot (every prompt still answered as transformers does)."""
    import logging

    import kvserve.runner.torch_runner as runner
    from test_architectures import expected

    _, folder = checkpoint(CASE, tmp_path_factory)
    per_slot = make_llm(folder).engine.runner.model.state_bytes(torch.float32)
    monkeypatch.setattr(runner, "free_memory_cap", lambda device: (3 * per_slot, "a test's cap"))
    with caplog.at_level(logging.INFO):
        llm = make_llm(folder, max_num_seqs=8)
    assert llm.engine.kv.state_slots == 3
    assert "--max-num-seqs 8 capped at a test's cap" in caplog.text
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == expected(CASE, tmp_path_factory)
