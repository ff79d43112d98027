"""Persimmon (Adept's 8B; Fuyu's language model): LayerNorms with biases, q/k/v in one tensor head by head
(``query_key_value``: GPT-NeoX's layout), a LayerNorm with a bias over each head of q and another over k's (shared by
the heads) where ``qk_layernorm``, rotary over the first ``partial_rotary_factor`` (half) of each head, biases on every
linear, a non-gated relu2 MLP (``dense_h_to_4h``, ``dense_4h_to_h``), every head its own K/V."""

from kvserve.model.architectures import Architecture, partial_rotary, register


def persimmon_config(d: dict) -> dict:
    qk_norms = {"qk_norm": "head", "qk_norm_type": "layer", "qk_norm_bias": True} if d.get("qk_layernorm", True) else {}
    return {**qk_norms, "num_key_value_heads": d["num_attention_heads"],
            "head_dim": d["hidden_size"] // d["num_attention_heads"], "norm_type": "layer",
            "rms_norm_eps": float(d.get("layer_norm_eps", 1e-5)), "gated_mlp": False,
            "hidden_act": d.get("hidden_act") or "relu2", "attention_bias": True, "o_proj_bias": True, "mlp_bias": True,
            "partial_rotary_factor": partial_rotary(d, 0.5)}


register(Architecture("PersimmonForCausalLM", persimmon_config, qkv_per_head=True, weights={
    "qkv_proj": "self_attn.query_key_value", "o_proj": "self_attn.dense", "q_norm": "self_attn.q_layernorm",
    "k_norm": "self_attn.k_layernorm", "gate_proj": None, "up_proj": "mlp.dense_h_to_4h",
    "down_proj": "mlp.dense_4h_to_h"},
    prefixes={"model.final_layernorm.": "model.norm.", "model.": "model.", "lm_head.": "lm_head."}))
