"""MPT (MosaicML's 7B, 30B): ALiBi (``attn_config``'s ``alibi_bias_max``, MPT's slopes), LayerNorms without biases, q/k/v
in one tensor (``Wqkv``), q/k/v clamped where ``clip_qkv``, no biases, a non-gated GELU MLP of 4 x hidden, tied
embeddings; MPT's config keys (``d_model``, ``n_heads``, ``n_layers``, ``max_seq_len``).
llama.cpp's "mpt" files: ALiBi's bias max (0: no ALiBi, refused) and the clamp as their own keys."""

from kvserve.model.architectures import Architecture, GGUFGet, register


def mpt_keys(d: dict) -> dict:
    out = {**d, "hidden_size": d.get("hidden_size") or d["d_model"],
           "num_attention_heads": d.get("num_attention_heads") or d["n_heads"],
           "num_hidden_layers": d.get("num_hidden_layers") or d["n_layers"],
           "max_position_embeddings": d.get("max_seq_len", 2048)}
    out["intermediate_size"] = 4 * out["hidden_size"]
    out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    out.setdefault("tie_word_embeddings", True)
    return out


def mpt_config(d: dict) -> dict:
    attn = d.get("attn_config") or {}
    if not attn.get("alibi", True) or attn.get("qk_ln"):
        raise ValueError("MPT without ALiBi, or with qk_ln, is not supported")
    if attn.get("kv_n_heads") not in (None, d["num_attention_heads"]):  # (MosaicML's grouped-query option)
        raise ValueError("MPT with kv_n_heads below the head count is not supported")
    out = {"num_key_value_heads": d["num_attention_heads"], "alibi": True, "alibi_mpt": True,
           "alibi_bias_max": float(attn.get("alibi_bias_max", 8)), "rope_layers": [False] * d["num_hidden_layers"],
           "norm_type": "layer", "norm_bias": False, "rms_norm_eps": float(d.get("layer_norm_epsilon", 1e-5)),
           "gated_mlp": False, "hidden_act": "gelu"}
    if attn.get("clip_qkv"):
        out["clip_qkv"] = float(attn["clip_qkv"])
    if attn.get("softmax_scale"):
        out["attn_scale"] = float(attn["softmax_scale"])
    return out


def mpt_gguf(get: GGUFGet) -> dict:
    bias_max = float(get("attention.max_alibi_bias", 0.0))
    return {"attn_config": {"alibi": bias_max > 0, "alibi_bias_max": bias_max, "clip_qkv": get("attention.clamp_kqv"),
                            "kv_n_heads": get("attention.head_count_kv")},
            "layer_norm_epsilon": float(get("attention.layer_norm_epsilon", 1e-5))}


register(Architecture("MptForCausalLM", mpt_config, text_config=mpt_keys, weights={
    "input_layernorm": "norm_1", "post_attention_layernorm": "norm_2", "qkv_proj": "attn.Wqkv",
    "o_proj": "attn.out_proj", "gate_proj": None, "up_proj": "ffn.up_proj", "down_proj": "ffn.down_proj"},
    prefixes={"transformer.wte.": "model.embed_tokens.", "transformer.blocks.": "model.layers.",
              "transformer.norm_f.": "model.norm.", "lm_head.": "lm_head."}, gguf="mpt", gguf_config=mpt_gguf))
