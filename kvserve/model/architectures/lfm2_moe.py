"""LFM2-MoE (LFM2-8B-A1B): LFM2's layers (short convolutions and attention) with experts from ``num_dense_layers``
on, each scored by its own sigmoid, chosen with a per-expert bias (``expert_bias``, where ``use_expert_bias``),
renormalised and times ``routed_scaling_factor``; the dense layers' MLP of ``intermediate_size`` as it is."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.lfm2 import LFM2_WEIGHTS, lfm2_config


def lfm2_moe_config(d: dict) -> dict:
    dense = d.get("num_dense_layers", 2)
    return {**lfm2_config({**d, "block_auto_adjust_ff_dim": False}), "num_experts": d["num_experts"],
            "num_experts_per_tok": d["num_experts_per_tok"], "moe_intermediate_size": d["moe_intermediate_size"],
            "norm_topk_prob": bool(d.get("norm_topk_prob", True)), "router_scoring": "sigmoid",
            "routed_scale": float(d.get("routed_scaling_factor") or 1.0),
            "selection_bias": bool(d.get("use_expert_bias", True)),
            "moe_layers": [i >= dense for i in range(d["num_hidden_layers"])]}


register(Architecture("Lfm2MoeForCausalLM", lfm2_moe_config, weights={
    **LFM2_WEIGHTS, "router": "feed_forward.gate", "selection_bias": "feed_forward.expert_bias",
    "expert": "feed_forward.experts.{e}.", "expert_gate": "w1", "expert_up": "w3", "expert_down": "w2"},
    prefixes={"model.embedding_norm.": "model.norm.", "model.": "model.", "lm_head.": "lm_head."}))
