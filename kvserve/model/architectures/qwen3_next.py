"""Qwen3-Next: three gated delta nets (``kvserve.model.gated_delta``) to each layer that attends (``layer_types``, or
every ``full_attention_interval``-th); gated attention (q_proj also gives the output's sigmoid gate) with per-head q/k
RMSNorms, a quarter of each head's dims rotating; every norm scales by 1 + weight; Qwen2-MoE's mixture of experts
(a shared expert under a sigmoid gate, ``decoder_sparse_step`` and ``mlp_only_layers``). Its delta nets' projections
come stacked a key head's group at a time (``in_proj_qkvz``, ``in_proj_ba``)."""

from kvserve.model.architectures import Architecture, first_of, partial_rotary, register
from kvserve.model.architectures.qwen_moe import moe_config


def delta_layers(d: dict) -> list[bool]:
    """Which layers are gated delta nets: ``layer_types``' "linear_attention", else all but every
    ``full_attention_interval``-th."""
    kinds = d.get("layer_types")
    if kinds is None:
        every = d.get("full_attention_interval") or 4
        return [(i + 1) % every != 0 for i in range(d["num_hidden_layers"])]
    return [kind == "linear_attention" for kind in kinds]


def gated_delta_config(d: dict) -> dict:
    """The gated delta nets and gated attention of Qwen3-Next and Qwen3.5 (their MLPs aside)."""
    return {"delta_layers": delta_layers(d), "delta_key_heads": d["linear_num_key_heads"],
            "delta_value_heads": d["linear_num_value_heads"], "delta_key_dim": d["linear_key_head_dim"],
            "delta_value_dim": d["linear_value_head_dim"], "delta_conv_kernel": d.get("linear_conv_kernel_dim", 4),
            "attn_output_gate": True, "qk_norm": "head", "norm_offset": 1.0,
            "partial_rotary_factor": partial_rotary(d, 0.25)}


def qwen3_next_config(d: dict) -> dict:
    return {**gated_delta_config(d), **moe_config(d),
            "shared_expert_intermediate_size": first_of(d, "shared_expert_intermediate_size", default=0)}


register(Architecture("Qwen3NextForCausalLM", qwen3_next_config, weights={
    "delta_qkvz": "linear_attn.in_proj_qkvz", "delta_ba": "linear_attn.in_proj_ba"}))
