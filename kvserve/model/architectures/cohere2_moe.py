"""Cohere 2 MoE: Cohere 2's layers (attention and the MLP side by side over one norm, rotary on interleaved pairs in
the sliding-window layers, logits times ``logit_scale``) with experts in the layers ``mlp_layer_types`` marks "sparse"
and a dense MLP of ``prefix_dense_intermediate_size`` in the others, whose attention rotates too where
``prefix_dense_sliding_window_pattern`` is 1. The router's top-k logits weighted by their softmax, or by their
sigmoids (renormalised where ``norm_topk_prob``: ``expert_selection_fn``); ``num_shared_experts`` shared experts (one
MLP) summed with the routed ones, or averaged with them (``shared_expert_combination_strategy`` "average": both halved,
the shared expert's half folded into its down projection at load). The norms are RMSNorms where ``rms_norm_eps`` is
set, else Cohere's LayerNorms without a bias."""

from typing import Any

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.cohere import cohere_config
from kvserve.model.config import FULL, SLIDING


def cohere2_moe_config(d: dict) -> dict:
    layers = d["num_hidden_layers"]
    pattern = d.get("sliding_window_pattern") or 4
    types = d.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    dense = [t == "dense" for t in (d.get("mlp_layer_types") or ["sparse"] * layers)]
    window = d.get("sliding_window") or None
    # a dense layer rotates whatever its window where its pattern is 1 (transformers' force_rope)
    force = d.get("prefix_dense_sliding_window_pattern", 1) == 1
    rotary = [(window is not None and t == SLIDING) or (force and dense[i]) for i, t in enumerate(types)]
    inter, shared = d["intermediate_size"], d.get("num_shared_experts") or 0
    selection = d.get("expert_selection_fn", "softmax")
    if selection not in ("softmax", "sigmoid"):
        raise ValueError(f"Cohere2MoeForCausalLM's expert_selection_fn {selection!r} is not softmax or sigmoid")
    strategy = d.get("shared_expert_combination_strategy", "average")
    if strategy not in ("sum", "average"):
        raise ValueError(f"Cohere2MoeForCausalLM's shared_expert_combination_strategy {strategy!r} is not sum or average")
    average = bool(shared) and strategy == "average"
    out = {**cohere_config(d), "sliding_window": window, "layer_types": list(types), "rope_layers": rotary,
           "intermediate_size": d.get("prefix_dense_intermediate_size") or inter,
           "num_experts": d["num_experts"], "num_experts_per_tok": d["num_experts_per_tok"],
           "moe_intermediate_size": inter, "moe_layers": [not x for x in dense],
           # a softmax over the chosen logits is the softmax renormalised over them
           "norm_topk_prob": selection == "softmax" or bool(d.get("norm_topk_prob", True)),
           "router_scoring": selection, "shared_expert_intermediate_size": inter * shared,
           "shared_expert_gated": False, "routed_scale": 0.5 if average else 1.0,
           "weight_multipliers": {"shared_expert_out": 0.5} if average else None}
    if d.get("rms_norm_eps") is not None:
        out.update(norm_type="rms", rms_norm_eps=float(d["rms_norm_eps"]))
    return out


def halve_shared_experts(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """The shared experts' down projections times their output scale (averaging with the routed experts: 0.5, exact
    in any float format), so that every path adds them as it adds an ungated shared expert."""
    factor = (cfg.weight_multipliers or {}).get("shared_expert_out")
    if factor is None:
        return weights
    for i in range(cfg.num_hidden_layers):
        key = f"model.layers.{i}.mlp.shared_experts.down_proj.weight"
        if key in weights:
            weights[key] = (weights[key].float() * factor).to(weights[key].dtype)
    return weights


register(Architecture("Cohere2MoeForCausalLM", cohere2_moe_config, adjust_weights=halve_shared_experts,
                      weights={"shared_expert": "mlp.shared_experts."}))
