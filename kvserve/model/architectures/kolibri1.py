"""Kolibri-1 (Aleph Alpha): norms before and after each sublayer (GLM-4's sandwich), EXAONE 4.0's attention (per-head
q/k norms; where a window is set, the sliding layers of ``layer_types`` rotate and the full ones attend without
positions); every layer's experts chosen by the router's logits plus a selection bias (``selection_on_logits``),
weighted by the chosen logits' sigmoids (renormalised where ``norm_topk_prob``), beside a shared expert without a
gate."""

from kvserve.model.architectures import Architecture, first_of, register
from kvserve.model.architectures.exaone4 import exaone4_config
from kvserve.model.config import FULL, SLIDING


def kolibri1_config(d: dict) -> dict:
    layers = d["num_hidden_layers"]
    types = d.get("layer_types") or [FULL if (i + 1) % 5 == 0 else SLIDING for i in range(layers)]
    return {**exaone4_config({**d, "layer_types": types}), "norm_layout": "sandwich",
            "num_experts": first_of(d, "num_experts", "num_local_experts"),
            "num_experts_per_tok": d["num_experts_per_tok"], "moe_intermediate_size": d["moe_intermediate_size"],
            "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
            "shared_expert_intermediate_size": d.get("shared_expert_intermediate_size") or 0,
            "shared_expert_gated": False, "router_scoring": "sigmoid", "selection_bias": True,
            "selection_on_logits": True}


register(Architecture("Kolibri1ForCausalLM", kolibri1_config, weights={
    "attn_out_norm": "post_attn_norm", "mlp_out_norm": "post_ffn_norm", "shared_expert": "mlp.shared_experts.",
    "selection_bias": "moe.router.expert_bias"}))
