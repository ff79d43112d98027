"""A.X-K1 (SK Telecom): DeepSeek-V3's latent attention (q always from its latent) and router (sigmoid scores chosen
with a selection bias from the best expert groups, ranked by their best two; shared experts without a gate), its
layers dense or sparse by ``mlp_layer_types`` (else ``first_k_dense_replace`` / ``moe_layer_freq``); each MoE
block's output, shared experts included, RMS-normed before the residual add (``post_mlp_layernorm``,
``ModelConfig.moe_out_norm``)."""

from typing import Any

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.deepseek_v2 import DEEPSEEK_WEIGHTS, latent_attention_config
from kvserve.model.architectures.deepseek_v3 import v3_experts


def axk1_config(d: dict) -> dict:
    kinds = d.get("mlp_layer_types")
    if kinds is None:  # the legacy keys, first_k_dense_replace defaulting to 1 as transformers' config does
        dense, every = d.get("first_k_dense_replace", 1), d.get("moe_layer_freq") or 1
        kinds = ["sparse" if i >= dense and i % every == 0 else "dense" for i in range(d["num_hidden_layers"])]
    return {**latent_attention_config(d), **v3_experts(d, [kind == "sparse" for kind in kinds]), "moe_out_norm": True}


def zero_absent_selection_bias(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """The released checkpoints route without ``e_score_correction_bias`` (transformers leaves it at zero): zeros
    where a MoE layer's is absent."""
    for i in range(cfg.num_hidden_layers):
        bias, router = (f"model.layers.{i}.{DEEPSEEK_WEIGHTS['selection_bias']}",
                        f"model.layers.{i}.mlp.gate.weight")
        if cfg.is_moe(i) and bias not in weights and router in weights:
            weights[bias] = weights[router].new_zeros(cfg.num_experts).float()
    return weights


register(Architecture("AXK1ForCausalLM", axk1_config, adjust_weights=zero_absent_selection_bias,
                      weights={**DEEPSEEK_WEIGHTS, "moe_out_norm": "post_mlp_layernorm"}))
