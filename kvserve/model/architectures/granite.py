"""Granite 3.x: Llama with four multipliers (embeddings, residual branches, the softmax scale, and logits divided)."""

from kvserve.model.architectures import Architecture, GGUFGet, register


def granite_config(d: dict) -> dict:
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    return {"embed_scale": float(d.get("embedding_multiplier", 1.0)),
            "residual_scale": float(d.get("residual_multiplier", 1.0)),
            "attn_scale": float(d.get("attention_multiplier", head_dim ** -0.5)),
            "logit_scale": 1.0 / float(d.get("logits_scaling", 1.0))}


def granite_gguf(get: GGUFGet) -> dict:
    """llama.cpp's names for the multipliers; each written only where set (else llama.cpp leaves that one out)."""
    keys = {"embedding_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
            "attention.scale": "attention_multiplier", "logit_scale": "logits_scaling"}
    return {hf: float(get(key)) for key, hf in keys.items() if get(key)}


register(Architecture("GraniteForCausalLM", granite_config, gguf="granite", gguf_permuted=True, gguf_config=granite_gguf))
