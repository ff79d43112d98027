"""Bamba (IBM's 9B): Mamba-2 layers (``kvserve.model.mamba``) but at ``attn_layer_indices``, where the layer attends
with half of each head's dims rotating (transformers fixes ``partial_rotary_factor`` at 0.5); a SiLU-gated MLP named
``feed_forward`` after ``pre_ff_layernorm``; the final norm ``final_layernorm``."""

from kvserve.model.architectures import Architecture, partial_rotary, register
from kvserve.model.architectures.mamba2 import mamba2_config


def bamba_config(d: dict) -> dict:
    layers = d["num_hidden_layers"]
    kinds = d.get("layers_block_type")  # older configs name each layer's kind
    if kinds is None:
        attends = set(d.get("attn_layer_indices") or [])
        kinds = ["attention" if i in attends else "mamba" for i in range(layers)]
    return {**mamba2_config(d, [kind in ("mamba", "linear_attention") for kind in kinds]),
            "partial_rotary_factor": partial_rotary(d, 0.5)}


register(Architecture("BambaForCausalLM", bamba_config, weights={
    "post_attention_layernorm": "pre_ff_layernorm", "gate_proj": "feed_forward.gate_proj",
    "up_proj": "feed_forward.up_proj", "down_proj": "feed_forward.down_proj"},
    prefixes={"model.final_layernorm.": "model.norm.", "model.": "model.", "lm_head.": "lm_head."}))
