"""AFMoE (Arcee's Trinity): norms before and after each sublayer (the sandwich layout), per-head q/k RMSNorms, rotary
only on the sliding-window layers (``layer_types``, or all but every ``global_attn_every_n_layers``-th), gated
attention whose sigmoid gate is a projection of its own (``self_attn.gate_proj``); a dense MLP in the first
``num_dense_layers`` layers, experts after them: each scored by its own sigmoid, chosen with a per-expert bias
(``mlp.expert_bias``), renormalised, times ``route_scale``, beside ``num_shared_experts`` shared experts (one MLP)
without a gate; the embeddings times sqrt(hidden) where ``mup_enabled``."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.config import FULL, SLIDING


def afmoe_config(d: dict) -> dict:
    if d.get("attention_bias"):  # the gate's projection has no bias, q's would: not a stacking kvserve reads
        raise ValueError("AfmoeForCausalLM with attention_bias is not supported")
    layers = d["num_hidden_layers"]
    every = d.get("global_attn_every_n_layers") or 4
    types = d.get("layer_types") or [SLIDING if (i + 1) % every else FULL for i in range(layers)]
    dense = d.get("num_dense_layers") or 0
    inter = d["moe_intermediate_size"]
    return {"norm_layout": "sandwich", "qk_norm": "head", "attn_output_gate": True,
            "sliding_window": d.get("sliding_window") or None, "layer_types": list(types),
            "rope_layers": [t == SLIDING for t in types],
            "num_experts": d["num_experts"], "num_experts_per_tok": d["num_experts_per_tok"],
            "moe_intermediate_size": inter, "moe_layers": [i >= dense for i in range(layers)],
            "router_scoring": "sigmoid", "selection_bias": True, "norm_topk_prob": True,
            "routed_scale": float(d.get("route_scale") or 1.0),
            "shared_expert_intermediate_size": inter * (d.get("num_shared_experts") or 0), "shared_expert_gated": False,
            "embed_scale": float(d["hidden_size"]) ** 0.5 if d.get("mup_enabled") else 1.0}


register(Architecture("AfmoeForCausalLM", afmoe_config, weights={
    "post_attention_layernorm": "pre_mlp_layernorm", "attn_out_norm": "post_attention_layernorm",
    "mlp_out_norm": "post_mlp_layernorm", "attn_gate_proj": "self_attn.gate_proj", "router": "mlp.router.gate",
    "selection_bias": "mlp.expert_bias", "shared_expert": "mlp.shared_experts."}))
