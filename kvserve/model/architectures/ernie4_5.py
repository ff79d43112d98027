"""ERNIE 4.5 (dense): Llama with rotary on interleaved pairs (q/k rows reordered at load: Llama's layers then, the
native decode stack's too) and biases on every linear where ``use_bias``."""

from kvserve.model.architectures import Architecture, register


def ernie4_5_config(d: dict) -> dict:
    bias = bool(d.get("use_bias", False))
    return {"rope_interleaved": True, "attention_bias": bias, "o_proj_bias": bias, "mlp_bias": bias,
            "tie_word_embeddings": d.get("tie_word_embeddings", True)}


# the biases follow the file's tensors (``gguf_loader``), which stand for use_bias
register(Architecture("Ernie4_5ForCausalLM", ernie4_5_config, gguf="ernie4_5"))
