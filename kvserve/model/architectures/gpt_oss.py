"""gpt-oss: a top-k mixture of experts in every layer (the router with a bias, softmax over the chosen logits;
experts with biases and a clamped SwiGLU, stored stacked: ``StackedExperts``), attention sinks, q/k/v/o biases,
sliding-window layers alternating with full ones, yarn rope."""

from kvserve.model.architectures import Architecture, StackedExperts, first_of, register
from kvserve.model.config import FULL, SLIDING


def gpt_oss_config(d: dict) -> dict:
    layers = d["num_hidden_layers"]
    types = d.get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
    return {"attn_sinks": True, "sliding_window": d.get("sliding_window") or None, "layer_types": list(types),
            "num_experts": first_of(d, "num_local_experts", "num_experts"),
            "num_experts_per_tok": d["num_experts_per_tok"],
            "moe_intermediate_size": d["intermediate_size"], "norm_topk_prob": True, "router_bias": True,
            "expert_bias": True, "swiglu_alpha": float(d.get("swiglu_alpha", 1.702)),
            "swiglu_limit": float(d.get("swiglu_limit", 7.0))}


register(Architecture("GptOssForCausalLM", gpt_oss_config, weights={"router": "mlp.router"},
                      stacked_experts=StackedExperts()))
