"""Phi-3 / Phi-3.5 / Phi-4-mini: q/k/v and gate/up stored stacked, longrope scaling, partial rotary (Phi-4-mini),
a sliding window where the config sets one."""

from kvserve.model.architectures import Architecture, GGUFGet, gguf_rotary_share, partial_rotary, register
from kvserve.model.config import rope_settings


def phi3_config(d: dict) -> dict:
    out = {"sliding_window": d.get("sliding_window") or None, "o_proj_bias": False,
           "partial_rotary_factor": partial_rotary(d, 1.0)}
    _, scaling = rope_settings(d)
    if scaling is not None and d.get("original_max_position_embeddings"):
        # longrope picks its factors by this length; transformers keeps it beside the scaling dict
        out["rope_scaling"] = {**scaling, "original_max_position_embeddings": d["original_max_position_embeddings"]}
    return out


def phi3_gguf(get: GGUFGet) -> dict:
    """The rotating share of each head (llama.cpp stores the rotating dims), and the length longrope's
    factors switch at."""
    return {**gguf_rotary_share(get), "original_max_position_embeddings": get("rope.scaling.original_context_length")}


register(Architecture("Phi3ForCausalLM", phi3_config, weights={"qkv_proj": "self_attn.qkv_proj",
                                                               "gate_up_proj": "mlp.gate_up_proj"},
                      gguf="phi3", gguf_config=phi3_gguf))
