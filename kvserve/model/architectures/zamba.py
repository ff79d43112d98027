"""Zamba (Zyphra's Zamba 7B): every layer a Mamba-1 layer of ``n_mamba_heads`` heads (each head's channels give its own
dt, B and C: ``kvserve.model.mamba.Mamba1``'s heads); before the "hybrid" layers' mixers one shared transformer block
(``kvserve.model.shared_block``) reads [stream, embeddings] with heads of ``attention_head_dim`` scaled as half that,
without positions, and a gated MLP of ``hidden_act``; no adapters. The checkpoints keep a hybrid layer's Mamba part
under ``mamba_decoder.``, the block under its first user's ``shared_transf.`` (each use its own copy where the
embeddings are untied: ``zamba2.shared_blocks``); per head x_proj [heads, rank + 2 state,
head dims], dt_proj [heads, head dims, rank] and their own-shaped A_log, D and dt bias (made block-diagonal and flat at
load: ``per_head_to_flat``); in_proj's rows alternate x and the gate (deinterleaved at load)."""

from typing import Any

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.zamba2 import shared_blocks


def zamba_config(d: dict) -> dict:
    layers, hidden, heads = d["num_hidden_layers"], d["hidden_size"], d["num_attention_heads"]
    kinds = d.get("layers_block_type") or d.get("layer_types")
    if kinds is None:  # transformers' default pattern
        period, offset = d.get("attn_layer_period", 6), d.get("attn_layer_offset", 4)
        kinds = ["mamba", "mamba", "hybrid"] + ["hybrid" if i % period == offset else "mamba"
                                                for i in range(layers - 3)]
    if int(d.get("attention_hidden_size") or 2 * hidden) != 2 * hidden:
        raise ValueError("Zamba's attention reads [stream, embeddings]: attention_hidden_size must be 2 x hidden_size")
    if d.get("hidden_mamba_act", "silu") != "silu":
        raise ValueError(f"hidden_mamba_act {d['hidden_mamba_act']!r} is not supported (silu)")
    head_dim = int(d.get("attention_head_dim") or 2 * hidden // heads)
    rank = d.get("mamba_dt_rank") or "auto"
    return {"mamba_layers": [True] * layers, "mamba_version": 1, "mamba_heads": int(d.get("n_mamba_heads", 1)),
            "mamba_inner": int(d.get("mamba_expand", 2) * hidden), "mamba_state_size": int(d.get("mamba_d_state", 16)),
            "mamba_dt_rank": -(-hidden // 16) if rank == "auto" else int(rank),
            "mamba_conv_kernel": int(d.get("mamba_d_conv", 4)), "mamba_conv_bias": bool(d.get("mamba_conv_bias", True)),
            "mamba_proj_bias": bool(d.get("mamba_proj_bias", False)),
            "layer_parts": ["mixer"] * layers, "head_dim": head_dim, "attn_scale": (head_dim / 2) ** -0.5,
            "rope_layers": [False] * layers, "attention_bias": False, "o_proj_bias": False, "mlp_bias": False,
            "tie_word_embeddings": d.get("tie_word_embeddings", True),
            "shared_block_layers": [k == "hybrid" for k in kinds],
            "shared_blocks": shared_blocks({**d, "num_mem_blocks": 1}, kinds)}


def per_head_to_flat(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """Each Mamba layer's per-head tensors as ``Mamba1`` takes them: x_proj and dt_proj block-diagonal (a head's block
    maps its own channels), A_log [inner, state], D and dt's bias [inner]; in_proj's alternating x and gate rows as x's,
    then the gate's."""
    import torch

    inner = cfg.mamba_inner
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mamba."
        if p + "x_proj.weight" not in weights:
            continue
        x_proj, dt_proj = weights[p + "x_proj.weight"], weights[p + "dt_proj.weight"]
        weights[p + "x_proj.weight"] = torch.block_diag(*x_proj.unbind(0))  # [heads x (rank + 2 state), inner]
        weights[p + "dt_proj.weight"] = torch.block_diag(*dt_proj.unbind(0))  # [inner, heads x rank]
        weights[p + "dt_proj.bias"] = weights[p + "dt_proj.bias"].reshape(inner)
        weights[p + "A_log"] = weights[p + "A_log"].reshape(inner, -1)
        weights[p + "D"] = weights[p + "D"].reshape(inner)
        for suffix in ("weight", "bias"):
            if (name := f"{p}in_proj.{suffix}") in weights:
                t = weights[name]
                weights[name] = t.view(inner, 2, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
    return weights


register(Architecture("ZambaForCausalLM", zamba_config, adjust_weights=per_head_to_flat, weights={
    "shared_block": "shared_transf.", "shared_block_proj": "linear", "post_attention_layernorm": "pre_ff_layernorm",
    "gate_proj": "feed_forward.gate_proj", "up_proj": "feed_forward.up_proj", "down_proj": "feed_forward.down_proj"},
    prefixes={"model.final_layernorm.": "model.norm.", "model.": "model.", "lm_head.": "lm_head."},
    renames={".mamba_decoder.": ".", ".x_proj_weight": ".x_proj.weight", ".dt_proj_weight": ".dt_proj.weight",
             ".dt_proj_bias": ".dt_proj.bias"}))
