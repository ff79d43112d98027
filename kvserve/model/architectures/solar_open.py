"""Solar Open (Upstage): Llama's attention (q/k/v biases where ``attention_bias``, none on o_proj, full rotary) with
GLM-4.5's experts in every layer: each scored by its own sigmoid, chosen with a per-expert bias
(``gate.e_score_correction_bias``) from the best ``topk_group`` of ``n_group`` groups (ranked by their best two),
renormalised where ``norm_topk_prob``, times ``routed_scaling_factor``; ``n_shared_experts`` shared experts (one MLP)
added without a gate."""

from kvserve.model.architectures import Architecture, first_of, register


def solar_open_config(d: dict) -> dict:
    inter = d["moe_intermediate_size"]
    return {"attention_bias": bool(d.get("attention_bias", False)), "o_proj_bias": False,
            "num_experts": first_of(d, "n_routed_experts", "num_local_experts"),
            "num_experts_per_tok": d["num_experts_per_tok"], "moe_intermediate_size": inter,
            "norm_topk_prob": bool(d.get("norm_topk_prob", True)), "router_scoring": "sigmoid",
            "routed_scale": float(d.get("routed_scaling_factor") or 1.0), "selection_bias": True,
            "shared_expert_intermediate_size": inter * (d.get("n_shared_experts") or 0), "shared_expert_gated": False,
            "expert_groups": d.get("n_group") or 1, "expert_groups_used": d.get("topk_group") or 1,
            "group_scoring": "top2"}


register(Architecture("SolarOpenForCausalLM", solar_open_config, weights={
    "shared_expert": "mlp.shared_experts.", "selection_bias": "mlp.gate.e_score_correction_bias"}))
