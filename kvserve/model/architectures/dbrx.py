"""DBRX (Databricks): q/k/v in one tensor (``Wqkv``) clamped to +-``clip_qkv``, ``kv_n_heads`` KV heads, rotary,
LayerNorms without biases, and in every layer a mixture of experts: a softmax over all of them, the top-k, their
weights renormalised to sum to 1 where ``moe_normalize_expert_weights`` is 1 (none where unset), each a SiLU-gated MLP.
The experts are stored stacked, each tensor [experts * ffn_hidden_size, d_model]: gate's (``w1``) and up's (``v1``)
rows as a linear's weight, down's (``w2``) transposed (``StackedExperts.up``, ``down_transposed``, ``flat``).
Its config nests the attention's and the experts' settings (``attn_config``, ``ffn_config``).
llama.cpp's "dbrx" files: the experts one [experts, rows, cols] tensor per weight (restacked at load, dequantized),
norm_2 as attn_output_norm, the clamp as its key; llama.cpp's graph always renormalises the top-k weights."""

from kvserve.model.architectures import Architecture, GGUFGet, StackedExperts, register


def dbrx_keys(d: dict) -> dict:
    """The top-level names of DBRX's own keys (``d_model``, ``n_heads``, ``n_layers``, ``max_seq_len``)."""
    out = {**d, "hidden_size": d.get("d_model") or d["hidden_size"],
           "num_attention_heads": d.get("n_heads") or d["num_attention_heads"],
           "num_hidden_layers": d.get("n_layers") or d["num_hidden_layers"],
           "max_position_embeddings": d.get("max_seq_len") or d.get("max_position_embeddings", 4096)}
    attn = d.get("attn_config") or {}
    out["num_key_value_heads"] = attn.get("kv_n_heads", 1)
    out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]  # (DBRX's heads always split d_model)
    if attn.get("rope_theta") and not d.get("rope_parameters"):  # (transformers 4 kept it in attn_config)
        out["rope_theta"] = attn["rope_theta"]
    return out


def dbrx_config(d: dict) -> dict:
    attn, ffn = d.get("attn_config") or {}, d.get("ffn_config") or {}
    p = ffn.get("moe_normalize_expert_weights", 1.0)
    if p not in (None, 1, 1.0):  # (an L-p norm of the top-k weights; every DBRX checkpoint's is 1)
        raise ValueError(f"moe_normalize_expert_weights {p} is not supported (1, or none)")
    return {"norm_type": "layer", "norm_bias": False, "rms_norm_eps": 1e-5, "clip_qkv": attn.get("clip_qkv"),
            "num_experts": ffn.get("moe_num_experts", 4), "num_experts_per_tok": ffn.get("moe_top_k", 1),
            "moe_intermediate_size": ffn.get("ffn_hidden_size", 3584), "norm_topk_prob": p is not None,
            "hidden_act": (ffn.get("ffn_act_fn") or {}).get("name", "silu"), "tie_word_embeddings": False}


def dbrx_gguf(get: GGUFGet) -> dict:
    return {"attn_config": {"kv_n_heads": int(get("attention.head_count_kv", 1)), "clip_qkv": get("attention.clamp_kqv")},
            "ffn_config": {"ffn_hidden_size": int(get("feed_forward_length")), "moe_num_experts": int(get("expert_count")),
                           "moe_top_k": int(get("expert_used_count")), "moe_normalize_expert_weights": 1.0}}


register(Architecture("DbrxForCausalLM", dbrx_config, text_config=dbrx_keys, weights={
    "input_layernorm": "norm_attn_norm.norm_1", "post_attention_layernorm": "norm_attn_norm.norm_2",
    "qkv_proj": "norm_attn_norm.attn.Wqkv", "o_proj": "norm_attn_norm.attn.out_proj", "router": "ffn.router.layer"},
    stacked_experts=StackedExperts(gate_up="ffn.experts.mlp.w1", up="ffn.experts.mlp.v1", down="ffn.experts.mlp.w2",
                                   interleaved=False, transposed=False, down_transposed=True, flat=True),
    prefixes={"transformer.wte.": "model.embed_tokens.", "transformer.blocks.": "model.layers.",
              "transformer.norm_f.": "model.norm.", "lm_head.": "lm_head."},
    gguf="dbrx", gguf_config=dbrx_gguf, gguf_roles={"attn_output_norm": "post_attention_layernorm"}))
