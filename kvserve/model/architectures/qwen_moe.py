"""Qwen2-MoE and Qwen3-MoE: a top-k mixture of experts in every ``decoder_sparse_step``-th layer (dense MLP in
``mlp_only_layers``); Qwen2-MoE adds a shared expert under a sigmoid gate and q/k/v biases, Qwen3-MoE q/k norms."""

from kvserve.model.architectures import Architecture, GGUFGet, first_of, register
from kvserve.model.architectures.qwen2 import qwen_window


def moe_config(d: dict) -> dict:
    layers, step = d["num_hidden_layers"], d.get("decoder_sparse_step") or 1
    dense = set(d.get("mlp_only_layers") or [])
    return {"num_experts": first_of(d, "num_experts", "num_local_experts"), "num_experts_per_tok": d["num_experts_per_tok"],
            "moe_intermediate_size": d["moe_intermediate_size"], "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
            "moe_layers": [i not in dense and (i + 1) % step == 0 for i in range(layers)]}


def qwen2_moe_config(d: dict) -> dict:
    return {**moe_config(d), "attention_bias": bool(d.get("qkv_bias", True)), "o_proj_bias": False,
            "shared_expert_intermediate_size": d.get("shared_expert_intermediate_size") or 0,
            # (transformers' config windows the even layers below max_window_layers)
            **qwen_window(d, lambda i: i % 2 == 0 and i < d.get("max_window_layers", 28))}


def qwen3_moe_config(d: dict) -> dict:
    return {**moe_config(d), "qk_norm": "head", **qwen_window(d, lambda i: True)}


def gguf_norm_topk(default: bool):
    """llama.cpp's graph renormalises the chosen experts' weights for qwen3moe, not for qwen2moe (unless
    the file says)."""
    return lambda get: {"norm_topk_prob": bool(get("expert_weights_norm", default))}


register(Architecture("Qwen2MoeForCausalLM", qwen2_moe_config, gguf="qwen2moe", gguf_config=gguf_norm_topk(False)))
register(Architecture("Qwen3MoeForCausalLM", qwen3_moe_config, gguf="qwen3moe", gguf_config=gguf_norm_topk(True)))
