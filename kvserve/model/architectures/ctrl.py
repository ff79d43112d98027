"""CTRL (Salesforce/ctrl): fixed sinusoidal positions from 0 (sin of every frequency, then cos: frequency k of
10000^(-2k / hidden)) added to embeddings scaled by sqrt(hidden), no rotary, pre-norm LayerNorms (eps 1e-6), q/k/v/o
with biases (``Wq``, ``Wk``, ``Wv``, ``dense``), a non-gated ReLU MLP with biases (``ffn.0``, ``ffn.2``), an LM head
with a bias over the embedding's weights. The checkpoints hold no position table (a buffer in transformers):
``adjust_weights`` makes it at load, read as a learned one; the tied head is its own copy of the embedding (the
decoder's head with a bias is untied) where the checkpoint stores none. Refused: a final norm's
``layer_norm_epsilon`` other than the layers' 1e-6."""

from typing import Any

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.gpt2 import gpt2_keys

LAYER_EPS = 1e-6  # transformers builds the layers' LayerNorms with it whatever the config says


def ctrl_keys(d: dict) -> dict:
    return {**gpt2_keys(d), "intermediate_size": d["dff"]}


def ctrl_config(d: dict) -> dict:
    if float(d.get("layer_norm_epsilon", LAYER_EPS)) != LAYER_EPS:
        raise ValueError(f"CTRLLMHeadModel with layer_norm_epsilon {d['layer_norm_epsilon']} (the final norm's; the "
                         f"layers' are {LAYER_EPS}) is not supported")
    return {"num_key_value_heads": d["num_attention_heads"], "learned_positions": True, "norm_type": "layer",
            "rms_norm_eps": LAYER_EPS, "gated_mlp": False, "hidden_act": "relu", "attention_bias": True,
            "o_proj_bias": True, "mlp_bias": True, "embed_scale": d["hidden_size"] ** 0.5, "lm_head_bias": True,
            "tie_word_embeddings": False}


def sinusoidal_positions(rows: int, dim: int) -> Any:
    """[rows, dim] in float32: row p holds sin(p r_k) for k < dim / 2, then cos(p r_k), r_k = 1 / 10000^(2k / dim)."""
    import torch

    rates = 1 / torch.pow(10000, (2 * (torch.arange(dim) // 2)).float() / dim)
    angles = torch.arange(rows).float()[:, None] * rates[None, :]
    return torch.cat([torch.sin(angles[:, 0::2]), torch.cos(angles[:, 1::2])], dim=-1)


def add_positions_and_head(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    weights["model.embed_positions.weight"] = sinusoidal_positions(cfg.max_position_embeddings, cfg.hidden_size)
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    return weights


register(Architecture("CTRLLMHeadModel", ctrl_config, text_config=ctrl_keys, adjust_weights=add_positions_and_head,
                      weights={"input_layernorm": "layernorm1", "post_attention_layernorm": "layernorm2",
                               "q_proj": "multi_head_attention.Wq", "k_proj": "multi_head_attention.Wk",
                               "v_proj": "multi_head_attention.Wv", "o_proj": "multi_head_attention.dense",
                               "gate_proj": None, "up_proj": "ffn.0", "down_proj": "ffn.2"},
                      prefixes={"transformer.w.": "model.embed_tokens.", "transformer.h.": "model.layers.",
                                "transformer.layernorm.": "model.norm.", "lm_head.": "lm_head."}))
