"""DeepSeek-V3 / R1, Kimi K2, Moonlight: DeepSeek-V2's latent attention (rotary pairs interleaved unless
``rope_interleave`` is false) and layer plan; each expert scored by its own sigmoid, chosen by the score plus a
per-expert bias (``e_score_correction_bias``) from the best ``topk_group`` of ``n_group`` groups (ranked by their best
two experts), weighted by the score renormalised and times ``routed_scaling_factor``. The multi-token-prediction
layers (``num_nextn_predict_layers``) are not read."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.deepseek_v2 import (DEEPSEEK_WEIGHTS, deepseek_experts, dense_first_layers,
                                                     latent_attention_config)


def deepseek_v3_config(d: dict) -> dict:
    experts = deepseek_experts({**d, "norm_topk_prob": d.get("norm_topk_prob", True)}, dense_first_layers(d),
                               d.get("n_group") or 1, d.get("topk_group") or 1)
    return {**latent_attention_config(d), **experts, "router_scoring": "sigmoid", "selection_bias": True,
            "group_scoring": "top2"}


register(Architecture("DeepseekV3ForCausalLM", deepseek_v3_config, weights=DEEPSEEK_WEIGHTS))
