"""Cohere (Command R, Aya 23, Aya Expanse): attention and the MLP side by side over one LayerNorm without a bias,
rotary on interleaved pairs, logits multiplied by ``logit_scale``, tied embeddings; where ``use_qk_norm``
(Command R+), a LayerNorm without a bias on each head of q and of k, its own weights each. llama.cpp's "command-r"
files."""

from kvserve.model.architectures import Architecture, GGUFGet, register


def cohere_config(d: dict) -> dict:
    qk_norms = {"qk_norm": "head", "qk_norm_type": "layer", "qk_norm_per_head": True} if d.get("use_qk_norm") else {}
    return {**qk_norms, "norm_type": "layer", "norm_bias": False, "rms_norm_eps": float(d.get("layer_norm_eps", 1e-5)),
            "norm_layout": "parallel", "rope_interleaved": True, "logit_scale": float(d.get("logit_scale", 1.0)),
            "tie_word_embeddings": d.get("tie_word_embeddings", True)}


def cohere_gguf(get: GGUFGet) -> dict:
    return {"logit_scale": float(get("logit_scale", 1.0)),
            "layer_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5))}


register(Architecture("CohereForCausalLM", cohere_config, gguf="command-r", gguf_config=cohere_gguf))
