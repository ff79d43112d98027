"""GLM-4.7-Flash (Glm4MoeLiteForCausalLM): DeepSeek-V3's latent attention and router (sigmoid scores, a selection
bias, expert groups ranked by their best two), its layers dense or sparse by ``mlp_layer_types`` (the first dense)."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.deepseek_v2 import DEEPSEEK_WEIGHTS, latent_attention_config
from kvserve.model.architectures.deepseek_v3 import v3_experts


def glm4_moe_lite_config(d: dict) -> dict:
    layers = d["num_hidden_layers"]
    plan = d.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    return {**latent_attention_config(d), **v3_experts(d, [kind == "sparse" for kind in plan])}


register(Architecture("Glm4MoeLiteForCausalLM", glm4_moe_lite_config, weights=DEEPSEEK_WEIGHTS))
