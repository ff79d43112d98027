"""GLM-4.5 / 4.6 MoE (GLM-4.5-Air, GLM-4.6): Llama's layers with q/k/v biases, rotary over the first half of each
head (``partial_rotary_factor``), q/k norms per head where ``use_qk_norm``; experts from ``first_k_dense_replace`` on,
each scored by its own sigmoid, chosen by the score plus a per-expert bias (``gate.e_score_correction_bias``),
weighted by the score renormalised and times ``routed_scaling_factor``, from the best ``topk_group`` of ``n_group``
expert groups (ranked by their best two); shared experts added without a gate."""

from kvserve.model.architectures import Architecture, GGUFGet, first_of, gguf_rotary_share, partial_rotary, register


def glm4_moe_config(d: dict) -> dict:
    layers, inter = d["num_hidden_layers"], d["moe_intermediate_size"]
    dense = d.get("first_k_dense_replace", 1)
    return {"attention_bias": bool(d.get("attention_bias", False)), "o_proj_bias": False,
            "qk_norm": "head" if d.get("use_qk_norm") else None, "partial_rotary_factor": partial_rotary(d, 0.5),
            "num_experts": first_of(d, "n_routed_experts", "num_local_experts"),
            "num_experts_per_tok": d["num_experts_per_tok"], "moe_intermediate_size": inter,
            "norm_topk_prob": bool(d.get("norm_topk_prob", True)), "router_scoring": "sigmoid",
            "routed_scale": float(d.get("routed_scaling_factor") or 1.0), "selection_bias": True,
            "shared_expert_intermediate_size": inter * (d.get("n_shared_experts") or 0), "shared_expert_gated": False,
            "moe_layers": [i >= dense for i in range(layers)], "expert_groups": d.get("n_group") or 1,
            "expert_groups_used": d.get("topk_group") or 1, "group_scoring": "top2"}


def glm4_moe_gguf(get: GGUFGet) -> dict:
    """llama.cpp's keys for the router and the layer plan (its graph scores by sigmoid: expert_gating_func 2); the
    block count includes the multi-token-prediction layers (``nextn_predict_layers``), which are not read."""
    return {**gguf_rotary_share(get), "n_shared_experts": int(get("expert_shared_count", 0)),
            "num_hidden_layers": int(get("block_count")) - int(get("nextn_predict_layers", 0)),
            "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
            "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(get("expert_weights_norm", True)),
            "n_group": int(get("expert_group_count", 1)), "topk_group": int(get("expert_group_used_count", 1))}


register(Architecture("Glm4MoeForCausalLM", glm4_moe_config, weights={
    "shared_expert": "mlp.shared_experts.", "selection_bias": "mlp.gate.e_score_correction_bias"},
    gguf="glm4moe", gguf_config=glm4_moe_gguf, gguf_roles={"post_attention_norm": "post_attention_layernorm"}))
