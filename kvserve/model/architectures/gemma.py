"""Gemma (1): Llama's layout with Gemma's norms (scaled by 1 + weight), GELU-tanh, embeddings scaled by sqrt(hidden)
and tied embeddings."""

from kvserve.model.architectures import Architecture, first_of, register


def gemma_common(d: dict) -> dict:
    """What every Gemma generation shares (Gemma 2 and 3 build on it)."""
    return {"norm_offset": 1.0, "hidden_act": first_of(d, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh"),
            "embed_scale": float(d["hidden_size"]) ** 0.5, "tie_word_embeddings": d.get("tie_word_embeddings", True)}


register(Architecture("GemmaForCausalLM", gemma_common, gguf="gemma"))
