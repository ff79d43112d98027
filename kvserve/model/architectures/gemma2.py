"""Gemma 2: norms before and after each sublayer (scaled by 1 + weight), GELU-tanh, embeddings scaled by
sqrt(hidden), soft caps on attention scores and logits, sliding-window layers alternating with global ones."""

from kvserve.model.architectures import Architecture, GGUFGet, first_of, register
from kvserve.model.architectures.gemma import gemma_common
from kvserve.model.config import FULL, SLIDING

# Gemma's names for the sandwich norms: theirs "post_attention_layernorm" is on attention's output
GEMMA_WEIGHTS = {"post_attention_layernorm": "pre_feedforward_layernorm", "attn_out_norm": "post_attention_layernorm",
                 "mlp_out_norm": "post_feedforward_layernorm"}


def gemma_config(d: dict, default_pattern: int) -> dict:
    """What Gemma 2 and 3 share. Older configs have no layer_types: every ``pattern``-th layer is global."""
    layers = d["num_hidden_layers"]
    pattern = first_of(d, "sliding_window_pattern", "_sliding_window_pattern", default=default_pattern)
    types = d.get("layer_types") or [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
    return {**gemma_common(d), "norm_layout": "sandwich",
            "attn_scale": float(first_of(d, "query_pre_attn_scalar", "head_dim",
                                          default=d["hidden_size"] // d["num_attention_heads"])) ** -0.5,
            "sliding_window": d.get("sliding_window") or None,
            "layer_types": list(types), "attn_logit_softcap": d.get("attn_logit_softcapping"),
            "final_logit_softcap": d.get("final_logit_softcapping"), "o_proj_bias": False}


def gemma_gguf(get: GGUFGet, big_layers: int) -> dict:
    """The query scale llama.cpp uses, not in the file: hidden / heads for the 27B model (known by its
    layer count, ``big_layers``), else the head size."""
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length") or hidden // heads)
    return {"query_pre_attn_scalar": hidden // heads if get("block_count") == big_layers else head_dim}


def gemma2_gguf(get: GGUFGet) -> dict:
    # llama.cpp's defaults where the file has no such key
    return {**gemma_gguf(get, 46), "sliding_window": get("attention.sliding_window", 4096),
            "attn_logit_softcapping": get("attn_logit_softcapping", 50.0),
            "final_logit_softcapping": get("final_logit_softcapping", 30.0)}


register(Architecture("Gemma2ForCausalLM", lambda d: gemma_config(d, 2), weights=GEMMA_WEIGHTS, gguf="gemma2",
                      gguf_config=gemma2_gguf))
