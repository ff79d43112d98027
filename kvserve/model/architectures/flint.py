"""Flint: Qwen3-MoE's attention (per-head q/k RMSNorms, biases where ``attention_bias``) with attention sinks (a logit
per head, ``softmax_offset`` in its checkpoints) and a sliding window on the layers ``layer_types`` marks (by default
all but the first two, every fourth and the last), which alone rotate (the full layers attend without positions);
experts (but in ``mlp_only_layers``) each scored by its own sigmoid, renormalised where ``norm_topk_prob``, beside a
shared expert added without a gate."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.qwen_moe import moe_config
from kvserve.model.config import FULL, SLIDING


def flint_config(d: dict) -> dict:
    layers = d["num_hidden_layers"]
    types = d.get("layer_types") or [FULL if i < 2 or i % 4 == 1 or i == layers - 1 else SLIDING for i in range(layers)]
    dense = d.get("mlp_only_layers")
    return {**moe_config({**d, "mlp_only_layers": [0, 1] if dense is None else dense}), "qk_norm": "head",
            "attn_sinks": True, "sliding_window": d.get("sliding_window") or None, "layer_types": list(types),
            "rope_layers": [t == SLIDING for t in types], "router_scoring": "sigmoid",
            "norm_topk_prob": bool(d.get("norm_topk_prob", True)),
            "shared_expert_intermediate_size": d.get("shared_expert_intermediate_size") or 0,
            "shared_expert_gated": False}


register(Architecture("FlintForCausalLM", flint_config, weights={"sinks": "self_attn.softmax_offset"}))
