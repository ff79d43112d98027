"""Granite 3.x: Llama with four multipliers (embeddings, residual branches, the softmax scale, and logits divided)."""

from kvserve.model.architectures import Architecture, register


def granite_config(d: dict) -> dict:
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    return {"embed_scale": float(d.get("embedding_multiplier", 1.0)),
            "residual_scale": float(d.get("residual_multiplier", 1.0)),
            "attn_scale": float(d.get("attention_multiplier", head_dim ** -0.5)),
            "logit_scale": 1.0 / float(d.get("logits_scaling", 1.0))}


register(Architecture("GraniteForCausalLM", granite_config))
