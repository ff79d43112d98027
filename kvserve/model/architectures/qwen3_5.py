"""Qwen3.5 and Qwen3.5-MoE: Qwen3-Next's layers (gated delta nets and gated attention: ``qwen3_next``) with the delta
nets' projections apart (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``); a SiLU-gated MLP, or in every
layer a mixture of experts renormalised over the chosen ones with a gated shared expert. The multimodal checkpoints
(``*ForConditionalGeneration``) are read as their text models; their multimodal rotary rotates a text token as plain
rotary does (``qwen_vl.text_rotary``)."""

from kvserve.model.architectures import Architecture, GGUFGet, gguf_rotary_share, register
from kvserve.model.architectures.gemma3_mm import text_part
from kvserve.model.architectures.qwen3_next import gated_delta_config
from kvserve.model.architectures.qwen_vl import VL_PREFIXES, text_rotary


def qwen3_5_moe_config(d: dict) -> dict:
    layers = d["num_hidden_layers"]
    return {**gated_delta_config(d), "num_experts": d["num_experts"], "num_experts_per_tok": d["num_experts_per_tok"],
            "moe_intermediate_size": d["moe_intermediate_size"], "norm_topk_prob": True, "moe_layers": [True] * layers,
            "shared_expert_intermediate_size": d.get("shared_expert_intermediate_size") or 0}


def qwen3_5_gguf(get: GGUFGet) -> dict:
    """The delta nets' shapes from llama.cpp's ssm keys (the state size is a key head's dim, the group count the key
    heads, the time-step rank the value heads); the block count includes the multi-token-prediction layers."""
    value_heads = int(get("ssm.time_step_rank"))
    return {**gguf_rotary_share(get), "linear_conv_kernel_dim": int(get("ssm.conv_kernel", 4)),
            "linear_key_head_dim": int(get("ssm.state_size")), "linear_num_key_heads": int(get("ssm.group_count")),
            "linear_num_value_heads": value_heads, "linear_value_head_dim": int(get("ssm.inner_size")) // value_heads,
            "full_attention_interval": int(get("full_attention_interval", 4)),
            "num_hidden_layers": int(get("block_count")) - int(get("nextn_predict_layers", 0))}


# llama.cpp's names for the delta nets' tensors, and for the norm before the MLP
QWEN3_5_GGUF_ROLES = {"post_attention_norm": "post_attention_layernorm", "attn_qkv": "delta_qkv", "attn_gate": "delta_z",
                      "ssm_beta": "delta_b", "ssm_alpha": "delta_a", "ssm_conv1d": "delta_conv", "ssm_norm": "delta_norm",
                      "ssm_out": "delta_out_proj", "ssm_a": "delta_A_log", "ssm_dt": "delta_dt_bias"}
dense, moe = text_rotary(gated_delta_config), text_rotary(qwen3_5_moe_config)
register(Architecture("Qwen3_5ForCausalLM", dense, gguf="qwen35", gguf_config=qwen3_5_gguf,
                      gguf_roles=QWEN3_5_GGUF_ROLES))
register(Architecture("Qwen3_5ForConditionalGeneration", dense, text_config=text_part, prefixes=VL_PREFIXES))
register(Architecture("Qwen3_5MoeForCausalLM", moe, gguf="qwen35moe", gguf_config=qwen3_5_gguf,
                      gguf_roles=QWEN3_5_GGUF_ROLES))
register(Architecture("Qwen3_5MoeForConditionalGeneration", moe, text_config=text_part, prefixes=VL_PREFIXES))
