"""Seed-OSS (ByteDance): Llama with q/k/v biases (``attention_bias``) and the output projection's own
(``attention_out_bias``)."""

from kvserve.model.architectures import Architecture, register

register(Architecture("SeedOssForCausalLM", lambda d: {"o_proj_bias": bool(d.get("attention_out_bias", False))}))
