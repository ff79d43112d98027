"""Laguna (poolside): per-head q/k RMSNorms, query heads that may differ by layer (``num_attention_heads_per_layer``:
``ModelConfig.attention_heads_per_layer``), a sliding window on the layers ``layer_types`` marks, rotary with each
layer type's own base and share of the head (``rope_parameters`` keyed by layer type: the full layers' as the model's,
the sliding layers' as ``rope_local_theta`` and ``rope_local_partial_rotary_factor``); attention's output times
softplus of a gate of its own projection (``g_proj``), one a head (``gating`` true or "per-head") or one a value
("per-element"). A dense MLP where ``mlp_layer_types`` says "dense", elsewhere experts: each scored by its own sigmoid
of the router's logits (soft-capped where ``moe_router_logit_softcapping``), chosen with a per-expert bias,
renormalised, times ``moe_routed_scaling_factor``, beside a shared expert without a gate."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.config import FULL, SLIDING


def layer_type_rope(d: dict) -> dict:
    """Each layer type's rotary from ``rope_parameters`` keyed by layer type (Laguna, Mellum): the full layers' share of
    each head (their base and scaling are the model's: ``config.rope_settings``), the sliding layers' own base and
    share, which rotate unscaled."""
    params = d.get("rope_parameters") or {}
    full, local = params.get(FULL), params.get(SLIDING)
    if not isinstance(full, dict):  # one set for every layer
        return {"partial_rotary_factor": float(params.get("partial_rotary_factor", 1.0))}
    out = {"partial_rotary_factor": float(full.get("partial_rotary_factor", 1.0))}
    if isinstance(local, dict):
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"{d['architectures'][0]} with a {local['rope_type']!r} rope on its sliding layers is not "
                             "supported (only the full layers' may be scaled)")
        out.update(rope_local_theta=float(local.get("rope_theta", 10000.0)),
                   rope_local_partial_rotary_factor=float(local.get("partial_rotary_factor", 1.0)))
    return out


def laguna_config(d: dict) -> dict:
    if d.get("moe_apply_router_weight_on_input"):
        raise ValueError("LagunaForCausalLM with moe_apply_router_weight_on_input is not supported (nor by transformers)")
    if d.get("attention_bias"):  # (the gate would share q's bias: one GEMM, one bias for all of its rows)
        raise ValueError("LagunaForCausalLM with attention_bias (q/k/v/o biased, g_proj not) is not supported")
    layers = d["num_hidden_layers"]
    types = d.get("layer_types") or [FULL] * layers
    mlp_types = d.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    heads = d.get("num_attention_heads_per_layer")
    cap = d.get("moe_router_logit_softcapping") or 0.0
    gating = d.get("gating", True)
    return {**layer_type_rope(d), "qk_norm": "head", "sliding_window": d.get("sliding_window") or None,
            "layer_types": list(types),
            "attention_heads_per_layer": None if heads is None else [int(h) for h in heads],
            "attn_output_gate": True, "attn_output_gate_fn": "softplus",
            "attn_output_gate_per_head": gating is True or gating == "per-head",
            "num_experts": d["num_experts"], "num_experts_per_tok": d["num_experts_per_tok"],
            "moe_intermediate_size": d["moe_intermediate_size"], "moe_layers": [t == "sparse" for t in mlp_types],
            "router_scoring": "sigmoid", "selection_bias": True, "norm_topk_prob": True,
            "routed_scale": float(d.get("moe_routed_scaling_factor") or 1.0),
            "router_logit_softcap": float(cap) if cap > 0 else None,
            "shared_expert_intermediate_size": d.get("shared_expert_intermediate_size") or 0,
            "shared_expert_gated": False}


register(Architecture("LagunaForCausalLM", laguna_config, weights={
    "attn_gate_proj": "self_attn.g_proj", "selection_bias": "mlp.experts.e_score_correction_bias",
    "shared_expert": "mlp.shared_expert."}))
