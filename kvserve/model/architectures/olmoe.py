"""OLMoE: a top-k mixture of experts in every layer (weights not renormalised by default), q/k norms over the
whole projection."""

from kvserve.model.architectures import Architecture, first_of, register


def olmoe_config(d: dict) -> dict:
    if d.get("clip_qkv") is not None:
        raise ValueError("OLMoE's clip_qkv is not supported")
    return {"qk_norm": "full", "num_experts": first_of(d, "num_experts", "num_local_experts"), "num_experts_per_tok": d["num_experts_per_tok"],
            "moe_intermediate_size": d["intermediate_size"], "norm_topk_prob": bool(d.get("norm_topk_prob", False))}


register(Architecture("OlmoeForCausalLM", olmoe_config, gguf="olmoe",
                      gguf_config=lambda get: {"norm_topk_prob": bool(get("expert_weights_norm", False))}))
