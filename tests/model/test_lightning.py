"""MiniMax's lightning attention (kvserve.model.lightning): a prompt longer than its blocks, run block by block from a
state, equals the decode step taken token by token."""

from __future__ import annotations

import torch

from kvserve.model.config import ModelConfig
from kvserve.model.lightning import LightningAttention


def test_blocks_equal_the_step_token_by_token():
    cfg = ModelConfig(vocab_size=10, hidden_size=32, intermediate_size=8, num_hidden_layers=4, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=8, delta_layers=[True] * 4, delta_rule="lightning")
    m = LightningAttention(cfg, 1)
    torch.manual_seed(0)
    u = torch.randn(2, 150, m.channels) * 0.5
    state = torch.randn(2, *m.state_shape) * 0.1
    o, after = m.recurrence(u, state.clone())
    states, slots, fresh = state.clone(), torch.tensor([0, 1]), torch.tensor([False, False])
    steps = [m.step(u[:, i : i + 1], states=states, slots=slots, fresh=fresh) for i in range(u.shape[1])]
    torch.testing.assert_close(o, torch.cat(steps, 1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after, states, atol=1e-4, rtol=1e-4)
