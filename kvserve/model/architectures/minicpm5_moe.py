"""MiniCPM5-MoE (OpenBMB): gated attention (q_proj also gives a sigmoid gate per value, each head's q then its gate,
as Qwen3-Next's; no q/k norms) over DeepSeek-V3's router (sigmoid scores chosen with a selection bias from the best
expert groups, ranked by their best two, renormalised, times ``routed_scaling_factor``; shared experts without a gate),
its layers dense or sparse by ``mlp_layer_types`` (else the first ``first_k_dense_replace`` dense)."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.deepseek_v2 import DEEPSEEK_WEIGHTS
from kvserve.model.architectures.deepseek_v3 import v3_experts


def minicpm5_moe_config(d: dict) -> dict:
    kinds = d.get("mlp_layer_types")
    if kinds is None:
        dense = d.get("first_k_dense_replace", 1)
        kinds = ["dense" if i < dense else "sparse" for i in range(d["num_hidden_layers"])]
    bias = bool(d.get("attention_bias", False))
    return {**v3_experts(d, [kind == "sparse" for kind in kinds]), "attn_output_gate": True, "attention_bias": bias,
            "o_proj_bias": bias}


# (the released config.json says "MiniCPM5MoEForCausalLM")
register(Architecture("MiniCPM5MoeForCausalLM", minicpm5_moe_config, weights=DEEPSEEK_WEIGHTS),
         aliases=("MiniCPM5MoEForCausalLM",))
