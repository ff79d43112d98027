"""Hunyuan MoE (Hunyuan-A13B): Hunyuan dense's attention (per-head q/k norms on the rotated q and k, the NTK alpha)
with a mixture of experts in every layer: the softmax's top ``moe_topk`` renormalised, each expert and the shared MLP
(added without a gate) of ``intermediate_size``, as transformers builds them. ``num_experts`` and ``moe_topk`` may
be per layer: equal values only."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.hunyuan_dense import HUNYUAN_WEIGHTS


def per_layer(d: dict, key: str) -> int:
    value = d[key]
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"HunYuanMoEV1ForCausalLM with {key} varying by layer ({sorted(set(value))}) is not "
                             "supported")
        value = value[0]
    return int(value)


def hunyuan_moe_config(d: dict) -> dict:
    inter = d["intermediate_size"]
    return {"qk_norm": "head", "qk_norm_after_rope": True, "num_experts": per_layer(d, "num_experts"),
            "num_experts_per_tok": per_layer(d, "moe_topk"), "moe_intermediate_size": inter, "norm_topk_prob": True,
            "shared_expert_intermediate_size": inter, "shared_expert_gated": False}


register(Architecture("HunYuanMoEV1ForCausalLM", hunyuan_moe_config, weights={
    **HUNYUAN_WEIGHTS, "router": "mlp.gate.wg", "shared_expert": "mlp.shared_mlp."}))
