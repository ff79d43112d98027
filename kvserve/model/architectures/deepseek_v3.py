"""DeepSeek-V3 / R1, Kimi K2, Moonlight: DeepSeek-V2's latent attention (rotary pairs interleaved unless
``rope_interleave`` is false) and layer plan; each expert scored by its own sigmoid, chosen by the score plus a
per-expert bias (``e_score_correction_bias``) from the best ``topk_group`` of ``n_group`` groups (ranked by their best
two experts), weighted by the score renormalised and times ``routed_scaling_factor``. The multi-token-prediction
layers (``num_nextn_predict_layers``) are not read."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.deepseek_v2 import (DEEPSEEK_WEIGHTS, deepseek_experts, dense_first_layers,
                                                     latent_attention_config)


def v3_experts(d: dict, moe_layers: list[bool], norm_topk_default: bool = True) -> dict:
    """DeepSeek-V3's experts and router, which GLM-4.7-Flash and dots.llm1 share: sigmoid scores chosen with the
    selection bias from the best expert groups, ranked by their best two."""
    experts = deepseek_experts({**d, "norm_topk_prob": d.get("norm_topk_prob", norm_topk_default)}, moe_layers,
                               d.get("n_group") or 1, d.get("topk_group") or 1)
    return {**experts, "router_scoring": "sigmoid", "selection_bias": True, "group_scoring": "top2"}


def deepseek_v3_config(d: dict) -> dict:
    return {**latent_attention_config(d), **v3_experts(d, dense_first_layers(d))}


register(Architecture("DeepseekV3ForCausalLM", deepseek_v3_config, weights=DEEPSEEK_WEIGHTS))
