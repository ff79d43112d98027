"""The gated delta rule (kvserve.model.gated_delta) against transformers' own, over a prompt longer than its chunks and
one token, from a state; and a chunked prompt equal to the whole one."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.config import ModelConfig
from kvserve.model.gated_delta import GatedDeltaNet


def delta_net() -> GatedDeltaNet:
    cfg = ModelConfig(vocab_size=10, hidden_size=32, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, delta_layers=[True], delta_key_heads=2, delta_value_heads=4,
                      delta_key_dim=16, delta_value_dim=8)
    torch.manual_seed(0)
    m = GatedDeltaNet(cfg, 0)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    return m


@pytest.mark.parametrize("length", [1, 9, 150])
def test_the_rule_equals_transformers(length):
    """transformers' chunked rule (chunks of 64) for a prompt, its recurrent one for a token: the outputs and the
    state after."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                     torch_recurrent_gated_delta_rule)

    m = delta_net()
    torch.manual_seed(1)
    u = torch.randn(2, length, m.channels)
    b, a = torch.randn(2, length, m.value_heads), torch.randn(2, length, m.value_heads)
    state = torch.randn(2, m.value_heads, m.key_dim, m.value_dim)
    o, after = m.recurrence(u, b, a, state.clone())
    q, k, v = u.split([m.keys, m.keys, m.values], dim=-1)
    rule = torch_recurrent_gated_delta_rule if length == 1 else torch_chunk_gated_delta_rule
    g = -m.A_log.detach().exp() * torch.nn.functional.softplus(a + m.dt_bias.detach())
    want, want_state = rule(q.reshape(2, length, m.key_heads, m.key_dim), k.reshape(2, length, m.key_heads, m.key_dim),
                            v.reshape(2, length, m.value_heads, m.value_dim), g=g, beta=b.sigmoid(),
                            initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, want.flatten(2), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after, want_state, atol=1e-4, rtol=1e-4)


def test_a_chunked_prompt_equals_the_whole_one():
    m = delta_net()
    torch.manual_seed(2)
    u, b, a = torch.randn(1, 40, m.channels), torch.randn(1, 40, m.value_heads), torch.randn(1, 40, m.value_heads)
    state = torch.zeros(1, *m.state_shape)
    conv = torch.zeros(1, m.taps - 1, m.channels)
    whole, _ = m.recurrence(m.convolve(u, conv)[0], b, a, state)
    parts = []
    for lo, hi in ((0, 1), (1, 3), (3, 40)):
        out, conv = m.convolve(u[:, lo:hi], conv)
        y, state = m.recurrence(out, b[:, lo:hi], a[:, lo:hi], state)
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts, 1), whole, atol=1e-5, rtol=1e-5)
