"""Phi-1, Phi-1.5, Phi-2: attention and a non-gated GELU MLP (``fc1``, ``fc2``) side by side over one LayerNorm,
rotary over the first ``partial_rotary_factor`` of each head, biases on every linear and on the LM head. Per-head
q/k LayerNorms (``qk_layernorm``) are refused. llama.cpp's "phi2" files."""

from kvserve.model.architectures import Architecture, GGUFGet, gguf_rotary_share, partial_rotary, register


def phi_config(d: dict) -> dict:
    if d.get("qk_layernorm"):
        raise ValueError("PhiForCausalLM with qk_layernorm (a LayerNorm per head for q and k) is not supported")
    return {"norm_type": "layer", "rms_norm_eps": float(d.get("layer_norm_eps", 1e-5)), "norm_layout": "parallel",
            "gated_mlp": False, "hidden_act": d.get("hidden_act") or "gelu_new", "attention_bias": True,
            "o_proj_bias": True, "mlp_bias": True, "lm_head_bias": True, "partial_rotary_factor": partial_rotary(d, 0.5)}


def phi_gguf(get: GGUFGet) -> dict:
    return {**gguf_rotary_share(get), "layer_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5))}


register(Architecture("PhiForCausalLM", phi_config, weights={
    "o_proj": "self_attn.dense", "gate_proj": None, "up_proj": "mlp.fc1", "down_proj": "mlp.fc2"},
    prefixes={"model.final_layernorm.": "model.norm.", "model.": "model.", "lm_head.": "lm_head."},
    gguf="phi2", gguf_config=phi_gguf))
