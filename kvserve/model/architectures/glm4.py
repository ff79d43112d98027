"""GLM-4 (0414): norms before and after each sublayer, gate and up stored stacked, q/k/v biases, rotary over the
first half of each head's dims (``partial_rotary_factor``) on interleaved pairs."""

from kvserve.model.architectures import Architecture, first_of, gguf_rotary_share, register


def glm4_config(d: dict) -> dict:
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    partial = first_of(d, "partial_rotary_factor", default=params.get("partial_rotary_factor", 0.5))
    return {"norm_layout": "sandwich", "attention_bias": bool(d.get("attention_bias", True)), "o_proj_bias": False,
            "partial_rotary_factor": float(partial), "rope_interleaved": True}


register(Architecture("Glm4ForCausalLM", glm4_config, weights={
    "attn_out_norm": "post_self_attn_layernorm", "mlp_out_norm": "post_mlp_layernorm",
    "gate_up_proj": "mlp.gate_up_proj"}, gguf="glm4", gguf_config=gguf_rotary_share))
