"""Phi-1, Phi-1.5, Phi-2: attention and a non-gated GELU MLP (``fc1``, ``fc2``) side by side over one LayerNorm,
rotary over the first ``partial_rotary_factor`` of each head, biases on every linear and on the LM head; where
``qk_layernorm``, one LayerNorm (with a bias) over each head of q, another over k's. llama.cpp's "phi2" files."""

from kvserve.model.architectures import Architecture, GGUFGet, gguf_rotary_share, partial_rotary, register


def phi_config(d: dict) -> dict:
    qk_norms = {"qk_norm": "head", "qk_norm_type": "layer", "qk_norm_bias": True} if d.get("qk_layernorm") else {}
    return {**qk_norms, "norm_type": "layer", "rms_norm_eps": float(d.get("layer_norm_eps", 1e-5)),
            "norm_layout": "parallel", "gated_mlp": False, "hidden_act": d.get("hidden_act") or "gelu_new",
            "attention_bias": True,
            "o_proj_bias": True, "mlp_bias": True, "lm_head_bias": True,
            "partial_rotary_factor": partial_rotary(d, 0.5)}


def phi_gguf(get: GGUFGet) -> dict:
    return {**gguf_rotary_share(get), "layer_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5))}


register(Architecture("PhiForCausalLM", phi_config, weights={
    "o_proj": "self_attn.dense", "q_norm": "self_attn.q_layernorm", "k_norm": "self_attn.k_layernorm",
    "gate_proj": None, "up_proj": "mlp.fc1", "down_proj": "mlp.fc2"},
    prefixes={"model.final_layernorm.": "model.norm.", "model.": "model.", "lm_head.": "lm_head."},
    gguf="phi2", gguf_config=phi_gguf))
