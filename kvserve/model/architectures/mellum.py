"""Mellum (JetBrains Mellum 2): Qwen3-MoE's layers (per-head q/k RMSNorms; experts by the softmax's top-k,
renormalised where ``norm_topk_prob``) with a sliding window on the layers ``layer_types`` marks, rotary with each
layer type's own base (``rope_parameters`` keyed by layer type, as Laguna's), and a dense MLP of ``intermediate_size``
where ``mlp_layer_types`` says "dense". The multi-token-prediction layer (``mtp.``) is not read."""

from kvserve.model.architectures import Architecture, first_of, register
from kvserve.model.architectures.laguna import layer_type_rope
from kvserve.model.config import FULL


def mellum_config(d: dict) -> dict:
    layers = d["num_hidden_layers"]
    mlp_types = d.get("mlp_layer_types") or ["sparse"] * layers
    return {**layer_type_rope(d), "qk_norm": "head",
            "sliding_window": d.get("sliding_window") or None, "layer_types": list(d.get("layer_types") or [FULL] * layers),
            "num_experts": first_of(d, "num_local_experts", "num_experts"), "num_experts_per_tok": d["num_experts_per_tok"],
            "moe_intermediate_size": d["moe_intermediate_size"], "norm_topk_prob": bool(d.get("norm_topk_prob", True)),
            "moe_layers": [t == "sparse" for t in mlp_types]}


register(Architecture("MellumForCausalLM", mellum_config))
