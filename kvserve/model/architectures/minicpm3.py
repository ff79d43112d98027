"""MiniCPM3 (OpenBMB): DeepSeek-V2's latent attention with its rotary dims as halves (not interleaved pairs) in
Llama's layers (dense MLPs); MiniCPM's multipliers: embeddings times ``scale_emb``, each sublayer's output times
``scale_depth / sqrt(layers)``, logits divided by ``hidden_size / dim_model_base``."""

import math

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.deepseek_v2 import latent_attention_config


def minicpm_scales(d: dict) -> dict:
    """MiniCPM's embedding, residual and logit multipliers (its config's defaults where a key is absent)."""
    layers, hidden = d["num_hidden_layers"], d["hidden_size"]
    depth = d.get("scale_depth", 1.4)
    depth = math.sqrt(layers) if depth is None else float(depth)
    base = d.get("dim_model_base", 256) or hidden
    return {"embed_scale": float(d.get("scale_emb", 12)), "residual_scale": depth / math.sqrt(layers),
            "logit_scale": base / hidden}


def minicpm3_config(d: dict) -> dict:
    # v_head_dim: transformers' default is hidden_size / heads
    v = d.get("v_head_dim") or d["hidden_size"] // d["num_attention_heads"]
    attention = latent_attention_config({**d, "v_head_dim": v, "rope_interleave": False})
    return {**attention, **minicpm_scales(d)}


register(Architecture("MiniCPM3ForCausalLM", minicpm3_config))
