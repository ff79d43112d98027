"""MiniCPM3 (OpenBMB): DeepSeek-V2's latent attention with its rotary dims as halves (not interleaved pairs) in
Llama's layers (dense MLPs); MiniCPM's multipliers: embeddings times ``scale_emb``, each sublayer's output times
``scale_depth / sqrt(layers)``, logits divided by ``hidden_size / dim_model_base``.
llama.cpp's "minicpm3" files: the latent shapes as keys (no value length: v is hidden / heads wide), kv_b whole; no key
for the multipliers, which llama.cpp's graph fixes at MiniCPM3-4B's (the config defaults here); longrope's factors as
tensors, with no original context in the file: refused."""

import math

from kvserve.model.architectures import Architecture, GGUFGet, register
from kvserve.model.architectures.deepseek_v2 import latent_attention_config
from kvserve.model.config import rope_settings


def minicpm_scales(d: dict) -> dict:
    """MiniCPM's embedding, residual and logit multipliers (its config's defaults where a key is absent)."""
    layers, hidden = d["num_hidden_layers"], d["hidden_size"]
    depth = d.get("scale_depth", 1.4)
    depth = math.sqrt(layers) if depth is None else float(depth)
    base = d.get("dim_model_base", 256) or hidden
    return {"embed_scale": float(d.get("scale_emb", 12)), "residual_scale": depth / math.sqrt(layers),
            "logit_scale": base / hidden}


def minicpm3_config(d: dict) -> dict:
    _, scaling = rope_settings(d)
    if scaling and scaling.get("rope_type") == "longrope" and not (
            scaling.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")):
        raise ValueError("MiniCPM3ForCausalLM with longrope and no original context (a GGUF file's) is not supported")
    # v_head_dim: transformers' default is hidden_size / heads
    v = d.get("v_head_dim") or d["hidden_size"] // d["num_attention_heads"]
    attention = latent_attention_config({**d, "v_head_dim": v, "rope_interleave": False})
    return {**attention, **minicpm_scales(d)}


def minicpm3_gguf(get: GGUFGet) -> dict:
    rope = int(get("rope.dimension_count"))
    return {"kv_lora_rank": int(get("attention.kv_lora_rank")), "q_lora_rank": int(get("attention.q_lora_rank", 0)),
            "qk_rope_head_dim": rope, "qk_nope_head_dim": int(get("attention.key_length")) - rope, "v_head_dim": None}


register(Architecture("MiniCPM3ForCausalLM", minicpm3_config, gguf="minicpm3", gguf_config=minicpm3_gguf))
