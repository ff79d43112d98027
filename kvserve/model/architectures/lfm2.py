"""LFM2 (Liquid's 350M-2.6B): layers whose token mixer is a short convolution (``conv_L_cache`` taps, B * x gated by
C: ``kvserve.model.short_conv``) but for those ``layer_types`` (or ``full_attn_idxs``) names attention (GQA, per-head
q/k RMSNorms); a SwiGLU MLP (``w1``, ``w3``, ``w2``) whose size LFM2 adjusts (``block_auto_adjust_ff_dim``); the final
norm named ``embedding_norm``; tied embeddings. llama.cpp's "lfm2" files."""

from kvserve.model.architectures import Architecture, GGUFGet, first_of, register


def lfm2_intermediate(d: dict) -> int:
    """The MLP's size as LFM2 derives it: 2/3 of ``block_ff_dim``, times the multiplier and rounded up to
    ``block_multiple_of`` where a multiplier is given."""
    inter = first_of(d, "block_ff_dim", "intermediate_size")
    if d.get("block_auto_adjust_ff_dim", True):
        inter = int(2 * inter / 3)
        if d.get("block_ffn_dim_multiplier") is not None:
            multiple = d.get("block_multiple_of", 256)
            inter = int(d["block_ffn_dim_multiplier"] * inter)
            inter = multiple * ((inter + multiple - 1) // multiple)
    return inter


def lfm2_config(d: dict) -> dict:
    layers = d["num_hidden_layers"]
    kinds = d.get("layer_types")
    if kinds is None:
        attends = set(d["full_attn_idxs"] if d.get("full_attn_idxs") is not None else range(layers))
        kinds = ["full_attention" if i in attends else "conv" for i in range(layers)]
    return {"conv_layers": [kind == "conv" for kind in kinds], "conv_kernel": int(d.get("conv_L_cache", 3)),
            "conv_bias": bool(d.get("conv_bias", False)), "qk_norm": "head", "intermediate_size": lfm2_intermediate(d),
            "rms_norm_eps": float(first_of(d, "norm_eps", "rms_norm_eps", default=1e-5)),
            "tie_word_embeddings": bool(first_of(d, "tie_embedding", "tie_word_embeddings", default=True))}


def lfm2_gguf(get: GGUFGet) -> dict:
    """llama.cpp's "lfm2" files: the attention layers are those with KV heads (a count per layer), the MLP's size
    already derived, the final norm as "token_embd_norm"."""
    kv = get("attention.head_count_kv")
    kinds = ["conv" if n == 0 else "full_attention" for n in kv] if isinstance(kv, list) else None
    return {"layer_types": kinds, "conv_L_cache": int(get("shortconv.l_cache", 3)), "block_auto_adjust_ff_dim": False,
            "norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5))}


LFM2_WEIGHTS = {"input_layernorm": "operator_norm", "post_attention_layernorm": "ffn_norm",
                "o_proj": "self_attn.out_proj",
                "q_norm": "self_attn.q_layernorm", "k_norm": "self_attn.k_layernorm",
                "gate_proj": "feed_forward.w1", "up_proj": "feed_forward.w3", "down_proj": "feed_forward.w2"}

register(Architecture("Lfm2ForCausalLM", lfm2_config, weights=LFM2_WEIGHTS, gguf="lfm2", gguf_config=lfm2_gguf,
                      gguf_globals={"token_embd_norm": "model.norm"},
                      prefixes={"model.embedding_norm.": "model.norm.", "model.": "model.", "lm_head.": "lm_head."}))
