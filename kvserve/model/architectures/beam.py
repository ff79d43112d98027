"""Beam: sandwich norms whose residual adds mix by depth (the n-th add: out / sqrt(n) + stream * sqrt((n - 1) / n)),
per-head q/k norms, attention gated by sigmoid(gate_proj(x) + a bias a head); sliding layers rotate, the full ones
attend without positions, their queries scaled by (1 + (position + 1) / 2048) ** 0.1; dense MLPs first
(``mlp_layer_types``), then experts scored by their own sigmoids, chosen with a per-expert bias from the best
``topk_group`` of ``n_group`` groups (ranked by their best two), renormalised, times ``routed_scaling_factor``;
logits soft-capped."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.config import FULL, SLIDING, rope_settings


def sliding_rope(d: dict, name: str) -> tuple:
    """(rope_theta, scaling) of the sliding layers, the only ones that rotate (Beam's, Ergo's): per layer type, the full
    layers' entry None; a rotary entry for them is refused."""
    params = d.get("rope_parameters") or {}
    if isinstance(params, dict) and FULL in params:
        if params.get(FULL) is not None:
            raise ValueError(f"{name} with rotary on its full-attention layers is not supported")
        params = params.get(SLIDING) or {}
    return rope_settings({"rope_parameters": params})


def beam_config(d: dict) -> dict:
    layers = d["num_hidden_layers"]
    types = d.get("layer_types") or [SLIDING if (i + 1) % 6 and i < layers - 1 else FULL for i in range(layers)]
    mlp_types = d.get("mlp_layer_types") or ["dense" if i < 3 else "sparse" for i in range(layers)]
    theta, scaling = sliding_rope(d, "BeamForCausalLM")
    groups = d.get("n_group") or 1
    return {"norm_layout": "sandwich", "residual_mix": "depth", "qk_norm": "head",
            "attn_output_gate": True, "attn_output_gate_bias": True,
            "sliding_window": d.get("sliding_window") or None, "layer_types": list(types),
            "rope_layers": [t == SLIDING for t in types], "rope_theta": theta or 10000.0, "rope_scaling": scaling,
            "query_position_scale": (0.1, 2048), "query_scale_offset": 1, "query_scale_nope": True,
            "query_scale_power": True,
            "num_experts": d["num_experts"], "num_experts_per_tok": d["num_experts_per_tok"],
            "moe_intermediate_size": d["moe_intermediate_size"], "moe_layers": [t == "sparse" for t in mlp_types],
            "norm_topk_prob": bool(d.get("norm_topk_prob", True)), "router_scoring": "sigmoid",
            "selection_bias": True, "expert_groups": groups, "expert_groups_used": d.get("topk_group") or groups,
            "group_scoring": "top2", "routed_scale": float(d.get("routed_scaling_factor") or 1.0),
            "final_logit_softcap": d.get("final_logit_softcapping")}


register(Architecture("BeamForCausalLM", beam_config, weights={
    "post_attention_layernorm": "pre_feedforward_layernorm", "attn_out_norm": "post_attention_layernorm",
    "mlp_out_norm": "post_feedforward_layernorm", "attn_gate_proj": "self_attn.gate_proj",
    "attn_gate_bias": "self_attn.gate_bias", "selection_bias": "mlp.gate.e_score_correction_bias"}))
