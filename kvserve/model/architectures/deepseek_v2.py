"""DeepSeek-V2 (V2-Lite, V2.5): multi-head latent attention (``kvserve.model.latent_attention``), rotary on
interleaved pairs of its rotary dims, the softmax scale times YaRN's ``mscale_all_dim`` factor squared; experts from
``first_k_dense_replace`` on (every ``moe_layer_freq``-th layer), chosen by the softmax greedily or from the best
expert groups (``topk_method`` "group_limited_greedy": groups ranked by their best expert), times
``routed_scaling_factor``; shared experts added without a gate. The pieces DeepSeek-V3 and GLM-4.7-Flash reuse."""

from kvserve.model.architectures import Architecture, GGUFGet, first_of, register

DEEPSEEK_WEIGHTS = {"shared_expert": "mlp.shared_experts.", "selection_bias": "mlp.gate.e_score_correction_bias"}


def latent_attention_config(d: dict) -> dict:
    """The latent attention's shape, its cache's heads and the softmax scale (YaRN's mscale_all_dim folded in, as
    DeepSeek's reference code scales every dim of q.k)."""
    from kvserve.model.config import rope_settings, yarn_mscale

    nope, rope, v = d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"]
    q_lora, bias = d.get("q_lora_rank") or 0, bool(d.get("attention_bias", False))
    if bias and not q_lora:
        raise ValueError(f"{d['architectures'][0]} with attention_bias and no q_lora_rank (q_proj without the bias "
                         "kv_a_proj has) is not supported")
    scale = (nope + rope) ** -0.5
    _, scaling = rope_settings(d)
    if scaling and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling.get("factor") or 1), float(scaling["mscale_all_dim"])) ** 2
    return {"kv_lora_rank": d["kv_lora_rank"], "q_lora_rank": q_lora, "qk_nope_head_dim": nope,
            "qk_rope_head_dim": rope, "v_head_dim": v, "head_dim": max(nope + rope, v),
            "num_key_value_heads": d["num_attention_heads"], "attn_scale": scale,
            "rope_interleaved": bool(d.get("rope_interleave", True)), "attention_bias": bias, "o_proj_bias": bias}


def deepseek_experts(d: dict, moe_layers: list[bool], groups: int, groups_used: int) -> dict:
    """DeepSeek's experts: routed ones on ``moe_layers``, shared ones without a gate, weights renormalised where
    ``norm_topk_prob`` and times ``routed_scaling_factor``; ``groups_used`` of ``groups`` expert groups."""
    inter = d["moe_intermediate_size"]
    return {"num_experts": first_of(d, "n_routed_experts", "num_experts"),
            "num_experts_per_tok": d["num_experts_per_tok"], "moe_intermediate_size": inter,
            "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
            "routed_scale": float(d.get("routed_scaling_factor") or 1.0),
            "shared_expert_intermediate_size": inter * (d.get("n_shared_experts") or 0), "shared_expert_gated": False,
            "moe_layers": moe_layers, "expert_groups": groups, "expert_groups_used": groups_used}


def dense_first_layers(d: dict) -> list[bool]:
    """Experts from ``first_k_dense_replace`` on, in every ``moe_layer_freq``-th layer."""
    dense, every = d.get("first_k_dense_replace") or 0, d.get("moe_layer_freq") or 1
    return [i >= dense and i % every == 0 for i in range(d["num_hidden_layers"])]


def deepseek_v2_config(d: dict) -> dict:
    out = latent_attention_config(d)
    if not first_of(d, "n_routed_experts", "num_experts"):
        return out
    method = d.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"DeepseekV2ForCausalLM with topk_method {method!r} is not supported (greedy, "
                         "group_limited_greedy)")
    grouped = method == "group_limited_greedy"
    groups, used = (d.get("n_group") or 1, d.get("topk_group") or 1) if grouped else (1, 1)
    return {**out, **deepseek_experts(d, dense_first_layers(d), groups, used)}


def deepseek2_gguf(get: GGUFGet) -> dict:
    """llama.cpp's "deepseek2" files (DeepSeek-V2/V3, Kimi, GLM-4.7-Flash): V3's router where the gating function is
    the sigmoid (2), V2's otherwise (the converters before that key wrote V2's); any multi-token-prediction layers
    in the block count left out; the latent shapes from the MLA keys
    (older files: the plain key and value lengths, and kv_b whole); YaRN's mscale_all_dim from its log multiplier,
    which the converter writes as 0.1 x it."""
    rope = int(get("rope.dimension_count"))
    qk, v = get("attention.key_length_mla"), get("attention.value_length_mla")
    if qk is None:
        qk, v = get("attention.key_length"), get("attention.value_length")
    groups, used = int(get("expert_group_count", 1)), int(get("expert_group_used_count", 1))
    sigmoid = int(get("expert_gating_func", 1)) == 2
    out = {"architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
           "num_hidden_layers": int(get("block_count")) - int(get("nextn_predict_layers", 0)),
           "kv_lora_rank": int(get("attention.kv_lora_rank")), "q_lora_rank": int(get("attention.q_lora_rank", 0)),
           "qk_rope_head_dim": rope, "qk_nope_head_dim": int(qk) - rope, "v_head_dim": int(v),
           "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
           "n_shared_experts": int(get("expert_shared_count", 0)),
           "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
           "norm_topk_prob": bool(get("expert_weights_norm", False)), "n_group": groups, "topk_group": used,
           "topk_method": "group_limited_greedy" if used < groups else "greedy"}
    if get("rope.scaling.yarn_log_multiplier"):
        mscale = float(get("rope.scaling.yarn_log_multiplier")) / 0.1
        out["rope_scaling"] = {"mscale": mscale, "mscale_all_dim": mscale}
    return out


register(Architecture("DeepseekV2ForCausalLM", deepseek_v2_config, weights=DEEPSEEK_WEIGHTS, gguf="deepseek2",
                      gguf_config=deepseek2_gguf))
