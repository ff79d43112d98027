"""Rotary frequencies of the scalings beyond transformers' reach in the architecture tests: dynamic NTK past the
original context (where transformers re-bases by the sequence's length, kvserve by the longest context, as vLLM),
Phi-3's first name for longrope, and Hunyuan's fixed NTK alpha."""

from __future__ import annotations

import torch

from kvserve.model.rotary import Rotary


def test_dynamic_ntk_is_plain_rope_within_the_context_whatever_original_max_position_embeddings_says():
    """transformers re-bases dynamic NTK only past max_position_embeddings (the table's length), ignoring the scaling's
    original_max_position_embeddings: every position in the table rotates as plain RoPE."""
    plain = Rotary(16, 256, 10000.0, None)
    dynamic = Rotary(16, 256, 10000.0, {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 64})
    assert torch.equal(dynamic.cos, plain.cos) and torch.equal(dynamic.sin, plain.sin)


def test_su_is_longrope():
    scaling = {"short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 3.0, 4.0, 5.0],
               "original_max_position_embeddings": 32}
    su, longrope = (Rotary(8, 128, 10000.0, {**scaling, "type": kind}) for kind in ("su", "longrope"))
    assert torch.equal(su.cos, longrope.cos) and torch.equal(su.sin, longrope.sin)


def test_dynamic_with_an_alpha_is_a_fixed_larger_base():
    alpha = Rotary(16, 64, 10000.0, {"rope_type": "dynamic", "alpha": 1000.0})
    plain = Rotary(16, 64, 10000.0 * 1000.0 ** (16 / 14), None)
    torch.testing.assert_close(alpha.cos, plain.cos)
    torch.testing.assert_close(alpha.sin, plain.sin)
