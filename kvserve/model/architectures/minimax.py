"""MiniMax-Text-01: lightning attention (``kvserve.model.lightning``: linear attention with a fixed decay per head) on
the layers ``layer_types`` (or ``attn_type_list``'s 0s) names, softmax attention (Mixtral's) on the rest; each
layer's norms feed its residual too (``norm_layout`` "normed_residual"), the residual and the sublayer's output
weighted by the alpha and beta factors of its kind (full or linear attention, the MLP); Mixtral's experts on every
layer. The original config.json's names (``layernorm_full_attention_alpha``, ...) are read too."""

from kvserve.model.architectures import Architecture, first_of, partial_rotary, register
from kvserve.model.architectures.mixtral import MIXTRAL_WEIGHTS


def minimax_layer_types(d: dict) -> list[str]:
    """``layer_types``, else ``attn_type_list`` (1: softmax attention), else transformers' default (from the first,
    every other layer attends)."""
    if d.get("layer_types"):
        return list(d["layer_types"])
    if d.get("attn_type_list"):
        return ["full_attention" if kind else "linear_attention" for kind in d["attn_type_list"]]
    return ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(d["num_hidden_layers"])]


def factor(d: dict, ours: str, original: str) -> float:
    return float(first_of(d, ours, original, default=1.0))


def minimax_config(d: dict) -> dict:
    name = d["architectures"][0]
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    if d.get("postnorm") is False:
        raise ValueError(f"{name} with postnorm false (the residual taken before the norms) is not supported")
    if d.get("rotary_dim") not in (None, head_dim) or partial_rotary(d, 1.0) != 1:
        raise ValueError(f"{name} with rotary_dim or partial_rotary_factor short of head_dim {head_dim} is not "
                         "supported (transformers rotates whole heads)")
    if (d.get("hidden_act") or "silu") != "silu":
        raise ValueError(f"{name} with hidden_act {d['hidden_act']!r} is not supported (silu)")
    kinds = minimax_layer_types(d)
    scales = []
    for kind in kinds:
        which = "linear" if kind == "linear_attention" else "full"
        scales.append((factor(d, f"{which}_attn_alpha_factor", f"layernorm_{which}_attention_alpha"),
                       factor(d, f"{which}_attn_beta_factor", f"layernorm_{which}_attention_beta"),
                       factor(d, "mlp_alpha_factor", "layernorm_mlp_alpha"),
                       factor(d, "mlp_beta_factor", "layernorm_mlp_beta")))
    return {"norm_layout": "normed_residual", "sublayer_scales": scales,
            "delta_layers": [kind == "linear_attention" for kind in kinds], "delta_rule": "lightning",
            "delta_norm_eps": 1e-6, "sliding_window": d.get("sliding_window") or None,
            "num_experts": first_of(d, "num_local_experts", "num_experts"),
            "num_experts_per_tok": d["num_experts_per_tok"], "moe_intermediate_size": d["intermediate_size"],
            "norm_topk_prob": True}


register(Architecture("MiniMaxForCausalLM", minimax_config, weights={
    **MIXTRAL_WEIGHTS, "delta_qkv": "self_attn.qkv_proj", "delta_z": "self_attn.output_gate",
    "delta_norm": "self_attn.norm.weight", "delta_out_proj": "self_attn.out_proj"}))
