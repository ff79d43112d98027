"""GLM-4.7-Flash (Glm4MoeLiteForCausalLM): DeepSeek-V3's latent attention and router (sigmoid scores, a selection
bias, expert groups ranked by their best two), its layers dense or sparse by ``mlp_layer_types`` (the first dense)."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.deepseek_v2 import DEEPSEEK_WEIGHTS, deepseek_experts, latent_attention_config


def glm4_moe_lite_config(d: dict) -> dict:
    layers = d["num_hidden_layers"]
    plan = d.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    experts = deepseek_experts({**d, "norm_topk_prob": d.get("norm_topk_prob", True)},
                               [kind == "sparse" for kind in plan], d.get("n_group") or 1, d.get("topk_group") or 1)
    return {**latent_attention_config(d), **experts, "router_scoring": "sigmoid", "selection_bias": True,
            "group_scoring": "top2"}


register(Architecture("Glm4MoeLiteForCausalLM", glm4_moe_lite_config, weights=DEEPSEEK_WEIGHTS))
