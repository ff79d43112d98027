"""gpt-oss: a top-k mixture of experts in every layer (the router with a bias, softmax over the chosen logits;
experts with biases and a clamped SwiGLU, stored stacked: ``StackedExperts``), attention sinks, q/k/v/o biases,
sliding-window layers alternating with full ones, yarn rope. llama.cpp's "gpt-oss" files: the experts in
MXFP4, gate and up apart, the norm before the MLP named "post_attention_norm"; its graph fixes what they do
not carry (sliding layers first, then alternating; the SwiGLU's alpha 1.702 and limit 7; yarn's correction
range truncated), which are the config's defaults."""

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
                      stacked_experts=StackedExperts(), gguf="gpt-oss",
                      gguf_roles={"post_attention_norm": "post_attention_layernorm"}))
