"""K-EXAONE (ExaoneMoeForCausalLM): EXAONE 4.0's attention (per-head q/k norms; where a window is set, the sliding
layers rotate and the global ones attend without positions) in pre-norm layers, over DeepSeek-V3's router (sigmoid
scores chosen with a selection bias from the best expert groups, ranked by their best two, renormalised, times
``routed_scaling_factor``) with ``num_shared_experts`` shared experts without a gate; dense or sparse layers by
``mlp_layer_types`` (else the first ``first_k_dense_replace`` dense). The MTP layers are not read."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.deepseek_v2 import DEEPSEEK_WEIGHTS
from kvserve.model.architectures.deepseek_v3 import v3_experts
from kvserve.model.architectures.exaone4 import exaone4_config


def exaone_moe_config(d: dict) -> dict:
    kinds = d.get("mlp_layer_types")
    if kinds is None:
        dense = d.get("first_k_dense_replace", 1)
        kinds = ["dense" if i < dense else "sparse" for i in range(d["num_hidden_layers"])]
    experts = v3_experts({**d, "n_shared_experts": d.get("num_shared_experts", 1)}, [k == "sparse" for k in kinds])
    return {**exaone4_config(d), **experts, "norm_layout": "pre"}


register(Architecture("ExaoneMoeForCausalLM", exaone_moe_config, weights={
    **DEEPSEEK_WEIGHTS, "selection_bias": "mlp.e_score_correction_bias"}))
