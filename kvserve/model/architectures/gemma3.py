"""Gemma 3 (text): Gemma 2's layers with q/k norms instead of the attention soft cap, five local layers (their own
RoPE base, unscaled unless rope_parameters scales them) to each global one."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.gemma2 import GEMMA_WEIGHTS, gemma_config, gemma_gguf
from kvserve.model.rope_config import local_rope_scaled


def gemma3_config(d: dict) -> dict:
    local = d.get("rope_local_base_freq")
    params = d.get("rope_parameters")
    if local is None and isinstance(params, dict) and "sliding_attention" in params:
        local = params["sliding_attention"].get("rope_theta")
    return {**gemma_config(d, 6), "qk_norm": "head", "rope_local_theta": float(local or 10000.0),
            "rope_local_scaled": local_rope_scaled(d)}


register(Architecture("Gemma3ForCausalLM", gemma3_config, weights=GEMMA_WEIGHTS, gguf="gemma3",
                      gguf_config=lambda get: gemma_gguf(get, 62)))
