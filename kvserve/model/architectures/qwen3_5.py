"""Qwen3.5 and Qwen3.5-MoE: Qwen3-Next's layers (gated delta nets and gated attention: ``qwen3_next``) with the delta
nets' projections apart (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``); a SiLU-gated MLP, or in every
layer a mixture of experts renormalised over the chosen ones with a gated shared expert. The multimodal checkpoints
(``*ForConditionalGeneration``) are read as their text models; their multimodal rotary rotates a text token as plain
rotary does (``qwen_vl.text_rotary``)."""

from typing import Any

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.gemma3_mm import text_part
from kvserve.model.architectures.qwen3_next import GATED_DELTA_GGUF_ROLES, gated_delta_config, gated_delta_gguf
from kvserve.model.architectures.qwen_vl import VL_PREFIXES, text_rotary


def qwen3_5_moe_config(d: dict) -> dict:
    layers = d["num_hidden_layers"]
    return {**gated_delta_config(d), "num_experts": d["num_experts"], "num_experts_per_tok": d["num_experts_per_tok"],
            "moe_intermediate_size": d["moe_intermediate_size"], "norm_topk_prob": True, "moe_layers": [True] * layers,
            "shared_expert_intermediate_size": d.get("shared_expert_intermediate_size") or 0}


def _untile(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    from kvserve.model.weight_layout import untile_value_heads  # (torch's side: this registry imports none)

    return untile_value_heads(cfg, weights)


dense, moe = text_rotary(gated_delta_config), text_rotary(qwen3_5_moe_config)
register(Architecture("Qwen3_5ForCausalLM", dense, gguf="qwen35", gguf_config=gated_delta_gguf,
                      gguf_roles=GATED_DELTA_GGUF_ROLES, gguf_weights=_untile))
register(Architecture("Qwen3_5ForConditionalGeneration", dense, text_config=text_part, prefixes=VL_PREFIXES))
register(Architecture("Qwen3_5MoeForCausalLM", moe, gguf="qwen35moe", gguf_config=gated_delta_gguf,
                      gguf_roles=GATED_DELTA_GGUF_ROLES, gguf_weights=_untile))
register(Architecture("Qwen3_5MoeForConditionalGeneration", moe, text_config=text_part, prefixes=VL_PREFIXES))
