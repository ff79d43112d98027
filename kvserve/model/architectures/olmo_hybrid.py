"""OLMo Hybrid: gated delta nets (``kvserve.model.gated_delta``) with q, k, v, the output gate (``g_proj``), a and b
each their own projection (and q, k and v their own convolution's tensor), the write strength doubled (``linear_allow_neg_eigval``), the gated norm at eps 1e-5, in
pre-norm layers (Llama's), between OLMo 3's post-norm attention layers (whole-projection q/k norms, no window);
rotary on the attention layers where ``rope_parameters`` gives a base, none otherwise (the released checkpoints)."""

from typing import Any

import torch

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.olmo2 import OLMO2_WEIGHTS
from kvserve.model.architectures.qwen3_next import delta_layers


def olmo_hybrid_config(d: dict) -> dict:
    heads = d["num_attention_heads"]
    key_heads = d.get("linear_num_key_heads") or heads
    key_dim = d.get("linear_key_head_dim") or int(0.75 * d["hidden_size"] / key_heads)
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    rotates = (params or {}).get("rope_theta") is not None or d.get("rope_theta") is not None
    layers = delta_layers(d)
    return {"norm_layout": "post", "recurrent_norm_layout": "pre", "qk_norm": "full", "delta_layers": layers,
            "delta_key_heads": key_heads, "delta_value_heads": d.get("linear_num_value_heads") or heads,
            "delta_key_dim": key_dim, "delta_value_dim": d.get("linear_value_head_dim") or 2 * key_dim,
            "delta_conv_kernel": d.get("linear_conv_kernel_dim", 4), "delta_norm_eps": 1e-5,
            "delta_beta_scale": 2.0 if d.get("linear_allow_neg_eigval", True) else 1.0,
            "rope_layers": None if rotates else [False] * len(layers)}


def resplit_convolutions(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """The convolution's q, k and v tensors cut at q's, k's and v's channels: transformers saves its joined kernel in
    three near-equal parts instead (what it joins back is the same; so is what kvserve joins)."""
    keys, values = cfg.delta_key_heads * cfg.delta_key_dim, cfg.delta_value_heads * cfg.delta_value_dim
    for i in range(cfg.num_hidden_layers):
        names = [f"model.layers.{i}.linear_attn.{x}_conv1d.weight" for x in "qkv"]
        if all(n in weights for n in names):
            whole = torch.cat([weights[n].reshape(weights[n].shape[0], -1) for n in names])
            for n, part in zip(names, whole.split([keys, keys, values])):
                weights[n] = part
    return weights


# the delta nets' tensors, and the norms as the checkpoints name them (transformers renames them at load): a pre-norm
# layer's "attention_layer_norm" and "feedforward_layer_norm" before its sublayers, the latter also a post-norm layer's
# on attention's output
register(Architecture("OlmoHybridForCausalLM", olmo_hybrid_config, adjust_weights=resplit_convolutions, weights={
    **OLMO2_WEIGHTS, "input_layernorm": "attention_layer_norm", "post_attention_layernorm": "feedforward_layer_norm",
    "attn_out_norm": "feedforward_layer_norm",
    "delta_q_conv": "linear_attn.q_conv1d", "delta_k_conv": "linear_attn.k_conv1d",
    "delta_v_conv": "linear_attn.v_conv1d", "delta_q": "linear_attn.q_proj",
    "delta_k": "linear_attn.k_proj", "delta_v": "linear_attn.v_proj", "delta_z": "linear_attn.g_proj",
    "delta_b": "linear_attn.b_proj", "delta_a": "linear_attn.a_proj", "delta_norm": "linear_attn.o_norm.weight",
    "delta_out_proj": "linear_attn.o_proj"}))
