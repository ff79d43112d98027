"""Lara Mini (Translated's Lara 4 Mini): Qwen3.5's gated delta nets among Qwen3's attention (per-head q/k RMSNorms, no
output gate) in a repeating pattern (``layer_types``: delta, sliding, delta, full, sliding by default), where only the
sliding layers rotate (over whole heads) and the full ones attend without positions; plain norms (weight, not 1 +
weight); in every layer experts chosen by the softmax's top-k (renormalised where ``norm_topk_prob``) beside a shared
expert added without a gate. Its checkpoints stack each delta net's input projections in one ``in_proj`` (q, k, v, z,
b, a), name the gated norm ``out_norm`` and stack the experts ([experts, 2 x inter, hidden], gate's rows first)."""

from kvserve.model.architectures import Architecture, StackedExperts, partial_rotary, register
from kvserve.model.architectures.qwen3_next import gated_delta_config
from kvserve.model.config import FULL, SLIDING, rope_settings

DELTA = "linear_attention"
PATTERN = [DELTA, SLIDING, DELTA, FULL, SLIDING]  # the layers' kinds where config.json lists none


def lara_mini_config(d: dict) -> dict:
    _, scaling = rope_settings(d)
    # its default rotary turns whole heads whatever partial_rotary_factor says; a scaled one would read the factor
    if scaling is not None and partial_rotary(d, 1.0) != 1.0:
        raise ValueError("LaraMiniForCausalLM with a scaled rope over part of each head is not supported")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"LaraMiniForCausalLM with hidden_act {d['hidden_act']} is not supported")
    kinds = list(d.get("layer_types") or [PATTERN[i % len(PATTERN)] for i in range(d["num_hidden_layers"])])
    return {**gated_delta_config({**d, "layer_types": kinds}), "attn_output_gate": False, "norm_offset": 0.0,
            "partial_rotary_factor": 1.0, "sliding_window": d.get("sliding_window") or None, "layer_types": kinds,
            "rope_layers": [k == SLIDING for k in kinds], "num_experts": d["num_experts"],
            "num_experts_per_tok": d["num_experts_per_tok"], "moe_intermediate_size": d["moe_intermediate_size"],
            "norm_topk_prob": bool(d.get("norm_topk_prob", True)), "moe_layers": [True] * len(kinds),
            "shared_expert_intermediate_size": d.get("shared_expert_intermediate_size") or 0,
            "shared_expert_gated": False}


register(Architecture("LaraMiniForCausalLM", lara_mini_config, weights={
    "delta_in_proj": "linear_attn.in_proj", "delta_norm": "linear_attn.out_norm.weight"},
    stacked_experts=StackedExperts(interleaved=False, transposed=False)))
