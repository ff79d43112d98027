"""Phi-3.5-MoE (PhimoeForCausalLM): Mixtral's layout (``block_sparse_moe``) with LayerNorms (with biases), q/k/v/o
biases where ``attention_bias``, an LM head with a bias where ``lm_head_bias``, Phi-3's rotary scalings (longrope), and
the sparsemixer router (two picks, each weighted by a softmax over the logits near it; ``router_jitter_noise``).
llama.cpp's "phimoe" files: Phi-3's keys (the rotating dims, longrope's factors as tensors and its attention factor,
which llama.cpp's graph applies in place of the checkpoint's short and long mscale: so does kvserve, from the file);
the router's jitter is not in the file (Phi-3.5-MoE's 0.01)."""

from kvserve.model.architectures import Architecture, GGUFGet, gguf_rotary_share, register
from kvserve.model.architectures.mixtral import MIXTRAL_WEIGHTS, mixtral_config


def phimoe_config(d: dict) -> dict:
    bias = bool(d.get("attention_bias", False))
    return {**mixtral_config(d), "norm_type": "layer", "attention_bias": bias, "o_proj_bias": bias,
            "lm_head_bias": bool(d.get("lm_head_bias", False)), "router_scoring": "sparsemixer",
            "router_jitter": float(d.get("router_jitter_noise", 0.01)), "norm_topk_prob": False}


def phimoe_gguf(get: GGUFGet) -> dict:
    return {**gguf_rotary_share(get), "original_max_position_embeddings": get("rope.scaling.original_context_length")}


register(Architecture("PhimoeForCausalLM", phimoe_config, weights=MIXTRAL_WEIGHTS, gguf="phimoe",
                      gguf_config=phimoe_gguf))
