"""Seed-OSS (ByteDance): Llama with q/k/v biases (``attention_bias``) and the output projection's own
(``attention_out_bias``). llama.cpp's "seed_oss" files (the biases as the file's tensors say)."""

from kvserve.model.architectures import Architecture, register

register(Architecture("SeedOssForCausalLM", lambda d: {"o_proj_bias": bool(d.get("attention_out_bias", False))},
                      gguf="seed_oss", gguf_roles={"post_attention_norm": "post_attention_layernorm"}))
