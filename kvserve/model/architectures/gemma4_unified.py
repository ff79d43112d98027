"""Gemma 4 unified (text): Gemma 4's text layers (``gemma4_config``: wider global heads, values from keys, K/V shared
by the last layers, double-wide MLPs, layer scalars) without per-layer inputs or experts; its config leaves their keys
out."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.gemma4 import GEMMA4_WEIGHTS, gemma4_config


def gemma4_unified_config(d: dict) -> dict:
    return gemma4_config({**d, "hidden_size_per_layer_input": 0, "enable_moe_block": False})


register(Architecture("Gemma4UnifiedForCausalLM", gemma4_unified_config, weights=GEMMA4_WEIGHTS))
