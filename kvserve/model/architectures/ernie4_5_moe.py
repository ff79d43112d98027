"""ERNIE 4.5 MoE (21B-A3B, 300B-A47B): ERNIE 4.5's layers with experts from ``moe_layer_start_index`` on (every
``moe_layer_interval``-th layer to ``moe_layer_end_index``), chosen by the softmax plus a per-expert bias
(``moe_statics.e_score_correction_bias``) and weighted by the softmax alone, renormalised; shared experts (one MLP
of ``moe_num_shared_experts`` times the experts' size) added without a gate."""

from kvserve.model.architectures import Architecture, GGUFGet, register
from kvserve.model.architectures.ernie4_5 import ernie4_5_config


def ernie4_5_moe_config(d: dict) -> dict:
    if d.get("use_bias"):
        raise ValueError("Ernie4_5_MoeForCausalLM with use_bias (biases on the shared experts) is not supported")
    layers, inter = d["num_hidden_layers"], d["moe_intermediate_size"]
    start, interval = d.get("moe_layer_start_index", 1), d.get("moe_layer_interval") or 1
    end = d.get("moe_layer_end_index", -1)
    end = layers - 1 if end is None or end < 0 else end
    return {**ernie4_5_config(d), "num_experts": d.get("moe_num_experts") or d["num_experts"],
            "num_experts_per_tok": d.get("moe_k") or d["num_experts_per_tok"], "moe_intermediate_size": inter,
            "norm_topk_prob": True, "selection_bias": True, "shared_expert_gated": False,
            "shared_expert_intermediate_size": inter * (d.get("moe_num_shared_experts") or 0),
            "moe_layers": [(i + 1) % interval == 0 and start <= i <= end for i in range(layers)]}


def ernie4_5_moe_gguf(get: GGUFGet) -> dict:
    return {"moe_num_shared_experts": int(get("expert_shared_count", 0)),
            "moe_layer_start_index": int(get("leading_dense_block_count", 0)),
            "moe_layer_interval": int(get("interleave_moe_layer_step", 1))}


register(Architecture("Ernie4_5_MoeForCausalLM", ernie4_5_moe_config, weights={
    "shared_expert": "mlp.shared_experts.", "selection_bias": "mlp.moe_statics.e_score_correction_bias"},
    gguf="ernie4_5-moe", gguf_config=ernie4_5_moe_gguf))
