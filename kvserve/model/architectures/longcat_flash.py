"""LongCat-Flash (Meituan): each checkpoint layer is two of ours (``Architecture.sublayers``: ``self_attn.{0,1}``,
``mlps.{0,1}``, ``input_layernorm.{0,1}``, ``post_attention_layernorm.{0,1}``), each latent attention (q from its
latent, rotary pairs interleaved) then a dense MLP, and the first's experts run beside its MLP on the same input, their
output added after the second's MLP (the shortcut-connected MoE: ``ModelConfig.moe_shortcut``). The router is a
softmax over the experts and ``zero_expert_num`` identity experts (``identity_experts``: they return their input),
chosen with ``e_score_correction_bias``, weighted by the softmax times ``routed_scaling_factor`` (not renormalised).
q's and k's latents are scaled by sqrt(hidden / rank) (``mla_scale_q_lora``, ``mla_scale_kv_lora``): folded into
q_b_proj and kv_a_layernorm at load. The MTP layers are not read."""

from typing import Any

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.deepseek_v2 import latent_attention_config


def longcat_text(d: dict) -> dict:
    """Our layer count (two a checkpoint layer) and the dense MLPs' width, under the common keys."""
    return {**d, "num_hidden_layers": 2 * d["num_layers"], "intermediate_size": d["ffn_hidden_size"]}


def longcat_config(d: dict) -> dict:
    if not d.get("q_lora_rank"):
        raise ValueError("LongcatFlashForCausalLM without q_lora_rank is not supported (transformers requires one)")
    if d.get("router_bias"):  # transformers builds the classifier's bias but leaves it out of the logits
        raise ValueError("LongcatFlashForCausalLM with router_bias is not supported (transformers ignores the bias)")
    layers = d["num_hidden_layers"]
    return {**latent_attention_config({**d, "rope_interleave": True}),
            "num_experts": d["n_routed_experts"], "num_experts_per_tok": d["moe_topk"],
            "moe_intermediate_size": d["expert_ffn_hidden_size"], "identity_experts": d.get("zero_expert_num") or 0,
            "routed_scale": float(d.get("routed_scaling_factor") or 1.0), "selection_bias": True,
            "moe_shortcut": True, "moe_layers": [False] * layers}


def fold_lora_scales(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """q (both its parts) times sqrt(hidden / q_lora_rank): into q_b_proj; k's latent after its norm times
    sqrt(hidden / kv_lora_rank) (k's own part and v both come from it): into the norm's weight."""
    q_scale = (cfg.hidden_size / cfg.q_lora_rank) ** 0.5
    kv_scale = (cfg.hidden_size / cfg.kv_lora_rank) ** 0.5
    for name in list(weights):
        if name.endswith("q_b_proj.weight"):
            weights[name] = weights[name] * q_scale
        elif name.endswith("kv_a_layernorm.weight"):
            weights[name] = weights[name] * kv_scale
    return weights


register(Architecture("LongcatFlashForCausalLM", longcat_config, text_config=longcat_text, sublayers=2,
                      adjust_weights=fold_lora_scales, weights={
    **{role: "self_attn.{s}." + name.removeprefix("self_attn.") for role, name in (
        ("q_a_proj", "self_attn.q_a_proj"), ("q_a_norm", "self_attn.q_a_layernorm"), ("q_b_proj", "self_attn.q_b_proj"),
        ("kv_a_proj", "self_attn.kv_a_proj_with_mqa"), ("kv_a_norm", "self_attn.kv_a_layernorm"),
        ("kv_b_proj", "self_attn.kv_b_proj"), ("o_proj", "self_attn.o_proj"))},
    "input_layernorm": "input_layernorm.{s}", "post_attention_layernorm": "post_attention_layernorm.{s}",
    "gate_proj": "mlps.{s}.gate_proj", "up_proj": "mlps.{s}.up_proj", "down_proj": "mlps.{s}.down_proj",
    "router": "mlp.router.classifier", "selection_bias": "mlp.router.e_score_correction_bias"}))
