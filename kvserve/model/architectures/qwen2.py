"""Qwen2 / Qwen2.5: Llama with biases on q, k and v."""

from kvserve.model.architectures import Architecture, register

register(Architecture("Qwen2ForCausalLM", lambda d: {"attention_bias": True, "o_proj_bias": False}, gguf="qwen2"))
