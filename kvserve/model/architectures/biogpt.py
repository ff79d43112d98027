"""BioGPT (BioGPT, BioGPT-Large): learned absolute positions 2 rows into their table, no rotary, pre-norm LayerNorms
(eps 1e-5 whatever ``layer_norm_eps`` says: transformers builds them with the default), biases on every linear, a
non-gated GELU MLP (``fc1``, ``fc2``), embeddings scaled by sqrt(hidden) (``scale_embedding``), the LM head
``output_projection`` tied; names under "biogpt."."""

import math

from kvserve.model.architectures import Architecture, register


def biogpt_config(d: dict) -> dict:
    return {"num_key_value_heads": d["num_attention_heads"], "learned_positions": True, "position_offset": 2,
            "norm_type": "layer", "rms_norm_eps": 1e-5, "gated_mlp": False, "hidden_act": d.get("hidden_act") or "gelu",
            "attention_bias": True, "o_proj_bias": True, "mlp_bias": True,
            "embed_scale": math.sqrt(d["hidden_size"]) if d.get("scale_embedding", True) else 1.0,
            "tie_word_embeddings": bool(d.get("tie_word_embeddings", True))}


register(Architecture("BioGptForCausalLM", biogpt_config, weights={
    "input_layernorm": "self_attn_layer_norm", "post_attention_layernorm": "final_layer_norm",
    "o_proj": "self_attn.out_proj", "gate_proj": None, "up_proj": "fc1", "down_proj": "fc2"},
    prefixes={"biogpt.layer_norm.": "model.norm.", "biogpt.": "model.", "output_projection.": "lm_head."}))
