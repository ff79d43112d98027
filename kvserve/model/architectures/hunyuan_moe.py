"""Hunyuan MoE (Hunyuan-A13B): Hunyuan dense's attention (per-head q/k norms on the rotated q and k, the NTK alpha)
with a mixture of experts in every layer: the softmax's top ``moe_topk`` renormalised, each expert and the shared MLP
(added without a gate) of ``intermediate_size``, as transformers builds them. ``num_experts`` and ``moe_topk`` may
be per layer: equal values only. llama.cpp's "hunyuan-moe" files: the alpha folded into the rope base (as Hunyuan
dense's), one shared MLP (another count refused)."""

from kvserve.model.architectures import Architecture, GGUFGet, register
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
    if per_layer({"n": d.get("num_shared_expert") or 1}, "n") != 1:
        raise ValueError("HunYuanMoEV1ForCausalLM with other than one shared MLP is not supported")
    return {"qk_norm": "head", "qk_norm_after_rope": True, "num_experts": per_layer(d, "num_experts"),
            "num_experts_per_tok": per_layer(d, "moe_topk"), "moe_intermediate_size": inter, "norm_topk_prob": True,
            "shared_expert_intermediate_size": inter, "shared_expert_gated": False}


def hunyuan_moe_gguf(get: GGUFGet) -> dict:
    return {"moe_topk": int(get("expert_used_count")), "num_shared_expert": int(get("expert_shared_count", 1))}


register(Architecture("HunYuanMoEV1ForCausalLM", hunyuan_moe_config, weights={
    **HUNYUAN_WEIGHTS, "router": "mlp.gate.wg", "shared_expert": "mlp.shared_mlp."}, gguf="hunyuan-moe",
    gguf_config=hunyuan_moe_gguf))
