"""VaultGemma: Gemma 2 with norms before each sublayer only (``input_layernorm``, ``pre_feedforward_layernorm``)."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.gemma2 import gemma_config

register(Architecture("VaultGemmaForCausalLM", lambda d: {**gemma_config(d, 2), "norm_layout": "pre",
                                                          # (o_proj's bias too where attention_bias)
                                                          "o_proj_bias": bool(d.get("attention_bias", False))},
                      weights={"post_attention_layernorm": "pre_feedforward_layernorm"}))
