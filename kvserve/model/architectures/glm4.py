"""GLM-4 (0414): norms before and after each sublayer, gate and up stored stacked, q/k/v biases, rotary over the
first half of each head's dims (``partial_rotary_factor``) on interleaved pairs. GLM (GLM-4-9B's "-hf" checkpoints,
GLM-Edge): the same without the norms after each sublayer."""

from kvserve.model.architectures import Architecture, gguf_rotary_share, partial_rotary, register


def glm4_config(d: dict) -> dict:
    return {"norm_layout": "sandwich", "attention_bias": bool(d.get("attention_bias", True)), "o_proj_bias": False,
            "partial_rotary_factor": partial_rotary(d, 0.5), "rope_interleaved": True}


register(Architecture("GlmForCausalLM", lambda d: {**glm4_config(d), "norm_layout": "pre"},
                      weights={"gate_up_proj": "mlp.gate_up_proj"}))
register(Architecture("Glm4ForCausalLM", glm4_config, weights={
    "attn_out_norm": "post_self_attn_layernorm", "mlp_out_norm": "post_mlp_layernorm",
    "gate_up_proj": "mlp.gate_up_proj"}, gguf="glm4", gguf_config=gguf_rotary_share))
