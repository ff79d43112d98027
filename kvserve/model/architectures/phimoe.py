"""Phi-3.5-MoE (PhimoeForCausalLM): Mixtral's layout (``block_sparse_moe``) with LayerNorms (with biases), q/k/v/o
biases where ``attention_bias``, an LM head with a bias where ``lm_head_bias``, Phi-3's rotary scalings (longrope), and
the sparsemixer router (two picks, each weighted by a softmax over the logits near it; ``router_jitter_noise``)."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.mixtral import MIXTRAL_WEIGHTS, mixtral_config


def phimoe_config(d: dict) -> dict:
    bias = bool(d.get("attention_bias", False))
    return {**mixtral_config(d), "norm_type": "layer", "attention_bias": bias, "o_proj_bias": bias,
            "lm_head_bias": bool(d.get("lm_head_bias", False)), "router_scoring": "sparsemixer",
            "router_jitter": float(d.get("router_jitter_noise", 0.01)), "norm_topk_prob": False}


register(Architecture("PhimoeForCausalLM", phimoe_config, weights=MIXTRAL_WEIGHTS))
