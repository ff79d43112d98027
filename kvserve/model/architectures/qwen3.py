"""Qwen3 (dense): an RMSNorm on each head of q and k before rotary, no biases."""

from kvserve.model.architectures import Architecture, register


def qwen3_config(d: dict) -> dict:
    return {"qk_norm": "head", "o_proj_bias": False}


register(Architecture("Qwen3ForCausalLM", qwen3_config, gguf="qwen3"))
