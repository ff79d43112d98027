"""StableLM (3B 4E1T, StableLM 2 1.6B, Zephyr): Llama's layers with LayerNorms (with biases), rotary over the first
``partial_rotary_factor`` of each head, q/k/v biases where ``use_qkv_bias``, and where ``use_parallel_residual``
attention and the MLP side by side over one norm; where ``qk_layernorm`` (StableLM 2 12B), a LayerNorm without a
bias on each head of q and of k, its own module each.
llama.cpp's "stablelm" files: the rotating dims as ``rope.dimension_count``, parallel where a layer has no ffn_norm."""

from kvserve.model.architectures import Architecture, GGUFGet, gguf_rotary_share, partial_rotary, register


def stablelm_config(d: dict) -> dict:
    qk_norms = {"qk_norm": "head", "qk_norm_type": "layer", "qk_norm_per_head": True} if d.get("qk_layernorm") else {}
    return {**qk_norms, "norm_type": "layer", "rms_norm_eps": float(d.get("layer_norm_eps", 1e-5)),
            "attention_bias": bool(d.get("use_qkv_bias", False)), "o_proj_bias": False,
            "partial_rotary_factor": partial_rotary(d, 0.25),
            "norm_layout": "parallel" if d.get("use_parallel_residual") else "pre"}


def stablelm_gguf(get: GGUFGet) -> dict:
    return {**gguf_rotary_share(get), "layer_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5))}


register(Architecture("StableLmForCausalLM", stablelm_config, weights={
    "q_norm": "self_attn.q_layernorm.norms.{h}", "k_norm": "self_attn.k_layernorm.norms.{h}"},
    gguf="stablelm", gguf_config=stablelm_gguf))
