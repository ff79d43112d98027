"""Qwen3-Next: three gated delta nets (``kvserve.model.gated_delta``) to each layer that attends (``layer_types``, or
every ``full_attention_interval``-th); gated attention (q_proj also gives the output's sigmoid gate) with per-head q/k
RMSNorms, a quarter of each head's dims rotating; every norm scales by 1 + weight; Qwen2-MoE's mixture of experts
(a shared expert under a sigmoid gate, ``decoder_sparse_step`` and ``mlp_only_layers``). Its delta nets' projections
come stacked a key head's group at a time (``in_proj_qkvz``, ``in_proj_ba``)."""

from typing import Any

from kvserve.model.architectures import Architecture, GGUFGet, first_of, gguf_rotary_share, partial_rotary, register
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


def gated_delta_gguf(get: GGUFGet) -> dict:
    """The delta nets' shapes from llama.cpp's ssm keys (the state size is a key head's dim, the group count the key
    heads, the time-step rank the value heads); the block count includes the multi-token-prediction layers."""
    value_heads = int(get("ssm.time_step_rank"))
    return {**gguf_rotary_share(get), "linear_conv_kernel_dim": int(get("ssm.conv_kernel", 4)),
            "linear_key_head_dim": int(get("ssm.state_size")), "linear_num_key_heads": int(get("ssm.group_count")),
            "linear_num_value_heads": value_heads, "linear_value_head_dim": int(get("ssm.inner_size")) // value_heads,
            "full_attention_interval": int(get("full_attention_interval", 4)),
            "num_hidden_layers": int(get("block_count")) - int(get("nextn_predict_layers", 0))}


# llama.cpp's names for the delta nets' tensors, and for the norm before the MLP
GATED_DELTA_GGUF_ROLES = {"post_attention_norm": "post_attention_layernorm", "attn_qkv": "delta_qkv",
                          "attn_gate": "delta_z", "ssm_beta": "delta_b", "ssm_alpha": "delta_a", "ssm_ba": "delta_ba",
                          "ssm_conv1d": "delta_conv", "ssm_norm": "delta_norm", "ssm_out": "delta_out_proj",
                          "ssm_a": "delta_A_log", "ssm_dt": "delta_dt_bias"}


def _join_delta(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    from kvserve.model.weight_layout import join_delta_gguf  # (torch's side: this registry imports none)

    return join_delta_gguf(cfg, weights)


register(Architecture("Qwen3NextForCausalLM", qwen3_next_config, weights={
    "delta_qkvz": "linear_attn.in_proj_qkvz", "delta_ba": "linear_attn.in_proj_ba"}, gguf="qwen3next",
    # (llama.cpp's qwen3next graph renormalises the chosen experts' weights)
    gguf_config=lambda get: {**gated_delta_gguf(get), "norm_topk_prob": True}, gguf_roles=GATED_DELTA_GGUF_ROLES,
    gguf_weights=_join_delta))
