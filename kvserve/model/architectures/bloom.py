"""BLOOM (560M-176B, BLOOMZ): ALiBi instead of positions (``ModelConfig.alibi``), a LayerNorm on the embeddings
(``word_embeddings_layernorm``), LayerNorms with biases, q/k/v in one tensor head by head (``query_key_value``), biases
on every linear, a non-gated GELU-tanh MLP, tied embeddings; BLOOM's config keys (``n_head``, ``n_layer``).
llama.cpp's "bloom" files: q/k/v as q's rows, then k's, then v's; the embeddings' norm as token_embd_norm."""

from kvserve.model.architectures import Architecture, GGUFGet, register


def bloom_keys(d: dict) -> dict:
    out = {**d, "num_attention_heads": d.get("num_attention_heads") or d["n_head"],
           "num_hidden_layers": d.get("num_hidden_layers") or d["n_layer"]}
    out["intermediate_size"] = 4 * d["hidden_size"]
    out["head_dim"] = d["hidden_size"] // out["num_attention_heads"]  # (BLOOM has no head_dim of its own)
    out.setdefault("tie_word_embeddings", True)
    return out


def bloom_config(d: dict) -> dict:
    if d.get("apply_residual_connection_post_layernorm"):
        raise ValueError("apply_residual_connection_post_layernorm (the residual taken after the norm) is not supported")
    layers = d["num_hidden_layers"]
    return {"num_key_value_heads": d["num_attention_heads"], "alibi": True, "rope_layers": [False] * layers,
            "embed_norm": True, "norm_type": "layer", "rms_norm_eps": float(d.get("layer_norm_epsilon", 1e-5)),
            "gated_mlp": False, "hidden_act": "gelu_pytorch_tanh", "attention_bias": True, "o_proj_bias": True,
            "mlp_bias": True}


def bloom_gguf(get: GGUFGet) -> dict:
    return {"layer_norm_epsilon": float(get("attention.layer_norm_epsilon", 1e-5))}


register(Architecture("BloomForCausalLM", bloom_config, text_config=bloom_keys, qkv_per_head=True, weights={
    "qkv_proj": "self_attention.query_key_value", "o_proj": "self_attention.dense", "gate_proj": None,
    "up_proj": "mlp.dense_h_to_4h", "down_proj": "mlp.dense_4h_to_h"},
    prefixes={f"{root}{theirs}": ours for root in ("transformer.", "")
              for theirs, ours in (("word_embeddings_layernorm.", "model.embed_norm."),
                                   ("word_embeddings.", "model.embed_tokens."), ("h.", "model.layers."),
                                   ("ln_f.", "model.norm."))} | {"lm_head.": "lm_head."},
    gguf="bloom", gguf_config=bloom_gguf, gguf_globals={"token_embd_norm": "model.embed_norm"}))
