"""OLMo 2: no norm before a sublayer, one on each sublayer's output; q/k norms over the whole projection."""

from kvserve.model.architectures import Architecture, register

OLMO2_WEIGHTS = {"input_layernorm": None, "post_attention_layernorm": None, "attn_out_norm": "post_attention_layernorm",
                 "mlp_out_norm": "post_feedforward_layernorm"}

register(Architecture("Olmo2ForCausalLM", lambda d: {"norm_layout": "post", "qk_norm": "full"}, weights=OLMO2_WEIGHTS,
                      gguf="olmo2"))
