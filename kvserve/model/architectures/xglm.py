"""XGLM (564M-7.5B): pre-norm LayerNorms with biases, q/k/v/o with biases, a non-gated GELU MLP (``fc1``, ``fc2``),
embeddings scaled by sqrt(d_model) (``scale_embedding``) and tied, and fixed sinusoidal positions added to them: a
table of sin then cos halves (base 10000, frequencies over half - 1 steps) starting 2 rows in, its ``pad_token_id``
row zero. The checkpoints hold no table (a buffer in transformers): ``adjust_weights`` makes it at load, so the
decoder reads it as a learned one (``learned_positions``, ``position_offset`` 2)."""

import math
from typing import Any

from kvserve.model.architectures import Architecture, register

OFFSET = 2  # the table's rows before position 0


def xglm_keys(d: dict) -> dict:
    """XGLM's config.json keys as the common ones."""
    return {**d, "hidden_size": d.get("hidden_size") or d["d_model"],
            "num_hidden_layers": d.get("num_hidden_layers") or d["num_layers"],
            "num_attention_heads": d.get("num_attention_heads") or d["attention_heads"],
            "intermediate_size": d["ffn_dim"], "tie_word_embeddings": d.get("tie_word_embeddings", True)}


def xglm_config(d: dict) -> dict:
    # transformers zeroes the table's pad_token_id row: below 2 (XGLM's 1) no position reads it
    if (d.get("pad_token_id") or 0) >= OFFSET:
        raise ValueError(f"XGLMForCausalLM with pad_token_id {d['pad_token_id']} (a zeroed position "
                         f"{d['pad_token_id'] - OFFSET} in its sinusoidal table) is not supported")
    return {"num_key_value_heads": d["num_attention_heads"], "learned_positions": True, "position_offset": OFFSET,
            "norm_type": "layer", "rms_norm_eps": 1e-5, "gated_mlp": False,
            "hidden_act": d.get("activation_function") or "gelu", "attention_bias": True, "o_proj_bias": True,
            "mlp_bias": True, "embed_scale": math.sqrt(d["hidden_size"]) if d.get("scale_embedding", True) else 1.0}


def sinusoidal_table(rows: int, dim: int) -> Any:
    """[rows, dim]: row p holds sin(p f_i) then cos(p f_i), f_i = 10000^(-i / (dim/2 - 1)) (a zero column where dim
    is odd), in float32."""
    import torch

    half = dim // 2
    freqs = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000) / (half - 1)))
    angles = torch.arange(rows, dtype=torch.float32)[:, None] * freqs[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles), torch.zeros(rows, dim % 2)], dim=1)
    return table


def add_position_table(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    weights["model.embed_positions.weight"] = sinusoidal_table(cfg.max_position_embeddings + OFFSET, cfg.hidden_size)
    return weights


register(Architecture("XGLMForCausalLM", xglm_config, text_config=xglm_keys, adjust_weights=add_position_table,
                      weights={"input_layernorm": "self_attn_layer_norm", "post_attention_layernorm": "final_layer_norm",
                               "o_proj": "self_attn.out_proj", "gate_proj": None, "up_proj": "fc1", "down_proj": "fc2"},
                      prefixes={"model.layer_norm.": "model.norm.", "model.": "model.", "lm_head.": "lm_head."}))
