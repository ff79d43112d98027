"""K-EXAONE (ExaoneMoeForCausalLM): EXAONE 4.0's attention (per-head q/k norms; where a window is set, the sliding
layers rotate and the global ones attend without positions) in pre-norm layers, over DeepSeek-V3's router (sigmoid
scores chosen with a selection bias from the best expert groups, ranked by their best two, renormalised, times
``routed_scaling_factor``) with ``num_shared_experts`` shared experts without a gate; dense or sparse layers by
``mlp_layer_types`` (else the first ``first_k_dense_replace`` dense). The MTP layers are not read.
llama.cpp's "exaone-moe" files: EXAONE 4's window keys, the router's as dots.llm1's, the block count with the MTP
layers (left out)."""

from kvserve.model.architectures import Architecture, GGUFGet, register
from kvserve.model.architectures.deepseek_v2 import DEEPSEEK_WEIGHTS
from kvserve.model.architectures.deepseek_v3 import v3_experts
from kvserve.model.architectures.dots1 import dots1_gguf
from kvserve.model.architectures.exaone4 import exaone4_config, exaone4_gguf


def exaone_moe_config(d: dict) -> dict:
    if (d.get("scoring_func") or "sigmoid") != "sigmoid":
        raise ValueError(f"ExaoneMoeForCausalLM with scoring_func {d['scoring_func']!r} is not supported (sigmoid)")
    kinds = d.get("mlp_layer_types")
    if kinds is None:
        dense = d.get("first_k_dense_replace", 1)
        kinds = ["dense" if i < dense else "sparse" for i in range(d["num_hidden_layers"])]
    experts = v3_experts({**d, "n_shared_experts": d.get("num_shared_experts", 1)}, [k == "sparse" for k in kinds])
    return {**exaone4_config(d), **experts, "norm_layout": "pre"}


def exaone_moe_gguf(get: GGUFGet) -> dict:
    if int(get("expert_gating_func", 2)) != 2:
        return {"scoring_func": "softmax"}  # refused by exaone_moe_config
    router = dots1_gguf(get)
    return {**exaone4_gguf(get), **router, "num_shared_experts": router.pop("n_shared_experts"),
            "num_hidden_layers": int(get("block_count")) - int(get("nextn_predict_layers", 0))}


register(Architecture("ExaoneMoeForCausalLM", exaone_moe_config, weights={
    **DEEPSEEK_WEIGHTS, "selection_bias": "mlp.e_score_correction_bias"}, gguf="exaone-moe",
    gguf_config=exaone_moe_gguf))
