"""Qwen3 (dense): an RMSNorm on each head of q and k before rotary, biases on q, k, v and o where ``attention_bias``;
Qwen2's sliding window where the config turns it on."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.qwen2 import from_max_window_layers, qwen_window


def qwen3_config(d: dict) -> dict:
    return {"qk_norm": "head", **qwen_window(d, from_max_window_layers(d))}


register(Architecture("Qwen3ForCausalLM", qwen3_config, gguf="qwen3"))
