"""GPT-NeoX-Japanese (abeja/gpt-neox-japanese-2.7b): GPT-NeoX's attention (q/k/v in one tensor head by head, rotary
over the first ``rotary_pct`` of each head, 1 by default) without biases, LayerNorms with biases before each sublayer
one after the other, a non-gated GELU MLP of ``intermediate_multiple_size`` x hidden without biases, tied embeddings.
Only the last layer's attention output takes a bias (``dense_bias``): the others' are zeros, made at load."""

from typing import Any

from kvserve.model.architectures import Architecture, first_of, partial_rotary, register

DENSE_BIAS = "model.layers.{i}.attention.dense.bias"


def gpt_neox_japanese_config(d: dict) -> dict:
    return {"num_key_value_heads": d["num_attention_heads"], "norm_type": "layer",
            "rms_norm_eps": float(d.get("layer_norm_eps", 1e-5)), "gated_mlp": False,
            "hidden_act": d.get("hidden_act") or "gelu", "attention_bias": False, "o_proj_bias": True,
            "intermediate_size": int(d["hidden_size"] * d.get("intermediate_multiple_size", 4)),
            "partial_rotary_factor": partial_rotary(d, float(d.get("rotary_pct", 1.0))),
            "rope_theta": float(first_of(d, "rotary_emb_base", "rope_theta",
                                         default=(d.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            "tie_word_embeddings": bool(d.get("tie_word_embeddings", True))}


def zero_dense_biases(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """The layers before the last have no attention output bias: zeros in its place."""
    import torch

    for i in range(cfg.num_hidden_layers):
        if DENSE_BIAS.format(i=i) not in weights:
            dense = weights[f"model.layers.{i}.attention.dense.weight"]
            weights[DENSE_BIAS.format(i=i)] = torch.zeros(cfg.hidden_size, dtype=dense.dtype)
    return weights


register(Architecture("GPTNeoXJapaneseForCausalLM", gpt_neox_japanese_config, weights={
    "qkv_proj": "attention.query_key_value", "o_proj": "attention.dense", "gate_proj": None,
    "up_proj": "mlp.dense_h_to_4h", "down_proj": "mlp.dense_4h_to_h"}, qkv_per_head=True,
    adjust_weights=zero_dense_biases, renames={"attention.dense_bias": "attention.dense.bias"},
    prefixes={"gpt_neox_japanese.embed_in.": "model.embed_tokens.", "gpt_neox_japanese.final_layer_norm.": "model.norm.",
              "gpt_neox_japanese.layers.": "model.layers.", "embed_out.": "lm_head."}))
