"""VaultGemma: Gemma 2 with norms before each sublayer only (``input_layernorm``, ``pre_feedforward_layernorm``)."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.gemma2 import gemma_config

register(Architecture("VaultGemmaForCausalLM", lambda d: {**gemma_config(d, 2), "norm_layout": "pre"},
                      weights={"post_attention_layernorm": "pre_feedforward_layernorm"}))
