"""Youtu-LLM (Tencent): DeepSeek-V3's latent attention (q from its latent or its own projection, rotary pairs
interleaved unless ``rope_interleave`` is false, YaRN's ``mscale_all_dim`` in the softmax scale) in Llama's layers,
every MLP dense."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.deepseek_v2 import latent_attention_config

register(Architecture("YoutuForCausalLM", latent_attention_config))
