"""Hunyuan dense (Hunyuan-0.5B to 7B): Llama with per-head q/k norms applied to the rotated q and k
(``query_layernorm``, ``key_layernorm``), and a fixed NTK alpha on the RoPE base (``rope_type`` "dynamic" with
``alpha``). llama.cpp's "hunyuan-dense" files: the alpha folded into the rope base by the converter (no scaling)."""

from kvserve.model.architectures import Architecture, register

HUNYUAN_WEIGHTS = {"q_norm": "self_attn.query_layernorm", "k_norm": "self_attn.key_layernorm"}

register(Architecture("HunYuanDenseV1ForCausalLM", lambda d: {"qk_norm": "head", "qk_norm_after_rope": True},
                      weights=HUNYUAN_WEIGHTS, gguf="hunyuan-dense"))
