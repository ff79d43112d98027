"""Hy3 (Tencent HYV3): Llama's attention with per-head q/k RMSNorms before rotary (biases on q/k/v/o where
``attention_bias``); a dense MLP where ``mlp_layer_types`` says "dense" (the first layer by default), elsewhere experts
each scored by its own sigmoid, chosen with a per-expert bias (``expert_bias``), renormalised, times
``router_scaling_factor``, beside ``num_shared_experts`` shared experts (one MLP, ``shared_mlp``) without a gate. The
multi-token-prediction layers past ``num_hidden_layers`` are not read; ``mlp_bias`` (which would give the shared
experts biases) is refused."""

from kvserve.model.architectures import Architecture, first_of, register


def hy_v3_config(d: dict) -> dict:
    if d.get("mlp_bias"):
        raise ValueError("HYV3ForCausalLM with mlp_bias (biases on its shared experts) is not supported")
    layers = d["num_hidden_layers"]
    mlp_types = d.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    inter = d["moe_intermediate_size"]
    return {"qk_norm": "head", "num_experts": first_of(d, "num_experts", "num_local_experts"),
            "num_experts_per_tok": d["num_experts_per_tok"], "moe_intermediate_size": inter,
            "moe_layers": [t == "sparse" for t in mlp_types], "router_scoring": "sigmoid", "selection_bias": True,
            "norm_topk_prob": True, "routed_scale": float(d.get("router_scaling_factor") or 1.0),
            "shared_expert_intermediate_size": inter * (d.get("num_shared_experts") or 0),
            "shared_expert_gated": False}


register(Architecture("HYV3ForCausalLM", hy_v3_config, weights={
    "router": "mlp.router.gate", "selection_bias": "mlp.expert_bias", "shared_expert": "mlp.shared_mlp."}))
