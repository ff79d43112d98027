"""OLMo (1, 0424, 0724): Llama's layers with LayerNorms that have neither weight nor bias (in float32), q/k/v clamped
where ``clip_qkv`` is set, biases where ``attention_bias``. llama.cpp's "olmo" files: the norms no tensors at all, the
clamp as its own key, q/k rows permuted as Llama's converter does."""

from kvserve.model.architectures import Architecture, GGUFGet, register


def olmo_config(d: dict) -> dict:
    clip, bias = d.get("clip_qkv"), bool(d.get("attention_bias", False))
    return {"norm_type": "layer", "norm_affine": False, "rms_norm_eps": 1e-5, "attention_bias": bias,
            "o_proj_bias": bias, "clip_qkv": None if clip is None else float(clip)}


def olmo_gguf(get: GGUFGet) -> dict:
    return {"clip_qkv": get("attention.clamp_kqv")}


register(Architecture("OlmoForCausalLM", olmo_config, gguf="olmo", gguf_permuted=True, gguf_config=olmo_gguf))
