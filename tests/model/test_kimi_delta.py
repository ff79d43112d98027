"""Kimi delta attention's rule (kvserve.model.kimi_delta) against transformers' own, over a prompt longer than its
blocks and one token (the decode step), from a state."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.config import ModelConfig
from kvserve.model.kimi_delta import KimiDeltaAttention


def kda() -> KimiDeltaAttention:
    cfg = ModelConfig(vocab_size=10, hidden_size=32, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, delta_layers=[True], delta_rule="kimi", delta_key_heads=2,
                      delta_value_heads=2, delta_key_dim=8, delta_value_dim=8, delta_gate_rank=8)
    torch.manual_seed(0)
    m = KimiDeltaAttention(cfg, 0)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    return m


@pytest.mark.parametrize("length", [1, 9, 100])
def test_the_rule_equals_transformers(length):
    """transformers' chunked rule (chunks of 64) for a prompt, its recurrent one for a token: the outputs and the
    state after; the step for the token too."""
    from transformers.models.kimi_linear.modeling_kimi_linear import (chunk_kimi_delta_attention,
                                                                       recurrent_kimi_delta_attention)

    m = kda()
    torch.manual_seed(1)
    u = torch.randn(2, length, m.channels)
    b, f = torch.randn(2, length, m.heads), torch.randn(2, length, m.width)
    state = torch.randn(2, m.heads, m.dim, m.dim)
    log_decay = m._log_decay(f.flatten(0, 1)).view(2, length, m.width)
    o, after = m.recurrence(u, b, log_decay, state.clone())
    q, k, v = (x.reshape(2, length, m.heads, m.dim) for x in u.split(m.width, dim=-1))
    rule = recurrent_kimi_delta_attention if length == 1 else chunk_kimi_delta_attention
    want, want_state = rule(q, k, v, g=log_decay.view(2, length, m.heads, m.dim), beta=b.sigmoid(),
                            initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, want.flatten(2), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after, want_state, atol=1e-4, rtol=1e-4)
    if length == 1:
        states = state.clone()
        got = m.step(u, b, log_decay, states=states, slots=torch.tensor([0, 1]), fresh=torch.tensor([False, False]))
        torch.testing.assert_close(got, want.flatten(2), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(states, want_state, atol=1e-4, rtol=1e-4)


def test_the_released_config_layout_reads_as_transformers_reads_it():
    """Kimi Linear's config.json as released (the layers and delta shapes in ``linear_attn_config``, 1-based; Kimi's
    expert key names; ``model_max_length``): the same ModelConfig as transformers' parse of it."""
    import transformers

    released = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 97,
                "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 8, "num_experts_per_token": 2,
                "num_shared_experts": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
                "routed_scaling_factor": 2.446, "first_k_dense_replace": 1, "moe_layer_freq": 1,
                "num_expert_group": 2, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": None,
                "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12, "mla_use_nope": True,
                "model_max_length": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1,
                "eos_token_id": 2, "pad_token_id": 0,
                "linear_attn_config": {"full_attn_layers": [2, 4], "kda_layers": [1, 3], "head_dim": 16,
                                       "num_heads": 4, "short_conv_kernel_size": 3}}
    ours = ModelConfig.from_hf_dict(released)
    theirs = transformers.KimiLinearConfig(**released).to_dict()
    assert ours == ModelConfig.from_hf_dict({**theirs, "architectures": released["architectures"]})
    assert ours.delta_layers == [True, False, True, False] and ours.delta_conv_kernel == 3
    assert (ours.num_experts, ours.num_experts_per_tok, ours.expert_groups, ours.max_position_embeddings) == (8, 2, 2,
                                                                                                          2048)
