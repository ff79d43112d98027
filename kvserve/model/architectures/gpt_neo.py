"""GPT-Neo (125M, 1.3B, 2.7B): GPT-2's layout (learned positions, LayerNorms with biases, a non-gated GELU MLP
``c_fc``/``c_proj`` as plain linears, tied embeddings) with q/k/v apart and without biases (o's has one), no softmax
scaling (scores are q.k as they are: ``attn_scale`` 1), and layers alternating global attention with local attention
over the last ``window_size`` tokens (the query's own among them: kvserve's sliding window), per
``attention_layers`` (or its run-length form ``attention_types``)."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.gpt2 import GPT2_PREFIXES
from kvserve.model.config import FULL, SLIDING


def gpt_neo_keys(d: dict) -> dict:
    """GPT-Neo's config.json keys as the common ones."""
    out = {**d, "num_hidden_layers": d.get("num_hidden_layers") or d["num_layers"],
           "num_attention_heads": d.get("num_attention_heads") or d["num_heads"]}
    out["intermediate_size"] = d.get("intermediate_size") or 4 * d["hidden_size"]
    out.setdefault("tie_word_embeddings", True)
    return out


def attention_layers(d: dict) -> list[str]:
    """Each layer's "global" or "local", from ``attention_layers`` or the runs of ``attention_types``
    ([[kinds, repeats], ...])."""
    if d.get("attention_layers"):
        return list(d["attention_layers"])
    return [kind for kinds, repeats in d.get("attention_types") or [[["global", "local"], 12]]
            for _ in range(repeats) for kind in kinds]


def gpt_neo_config(d: dict) -> dict:
    kinds = attention_layers(d)
    if len(kinds) != d["num_hidden_layers"]:
        raise ValueError(f"GPTNeoForCausalLM's attention_layers name {len(kinds)} layers of {d['num_hidden_layers']}")
    local = "local" in kinds
    return {"num_key_value_heads": d["num_attention_heads"], "learned_positions": True, "norm_type": "layer",
            "rms_norm_eps": float(d.get("layer_norm_epsilon", 1e-5)), "gated_mlp": False,
            "hidden_act": d.get("activation_function") or "gelu_new", "attention_bias": False, "o_proj_bias": True,
            "mlp_bias": True, "attn_scale": 1.0, "tie_word_embeddings": bool(d.get("tie_word_embeddings", True)),
            "sliding_window": d.get("window_size", 256) if local else None,
            "layer_types": [SLIDING if k == "local" else FULL for k in kinds] if local else None}


register(Architecture("GPTNeoForCausalLM", gpt_neo_config, text_config=gpt_neo_keys, prefixes=GPT2_PREFIXES, weights={
    "input_layernorm": "ln_1", "post_attention_layernorm": "ln_2", "q_proj": "attn.attention.q_proj",
    "k_proj": "attn.attention.k_proj", "v_proj": "attn.attention.v_proj", "o_proj": "attn.attention.out_proj",
    "gate_proj": None, "up_proj": "mlp.c_fc", "down_proj": "mlp.c_proj"}))
