"""GPT-2 and GPTBigCode (StarCoder 1, SantaCoder): learned absolute positions added to the token embeddings, no
rotary, LayerNorms with biases before each sublayer, q/k/v in one tensor (``c_attn``; one KV head where BigCode's
``multi_query``), biases on every linear, a non-gated MLP (``c_fc``, ``c_proj``), tied embeddings. GPT-2's linears
are Conv1D modules, stored [in, out] (``transposed_linears``). Their config.json keys are GPT-2's own (``n_embd``,
``n_layer``, ...).
llama.cpp's "gpt2" files: the linears transposed to [out, in] by the converter, the embedding written again as the
output tensor (so the file loads untied); "starcoder" (GPTBigCode): one KV head, linears as they are."""

from kvserve.model.architectures import Architecture, GGUFGet, register

GPT2_WEIGHTS = {"input_layernorm": "ln_1", "post_attention_layernorm": "ln_2", "qkv_proj": "attn.c_attn",
                "o_proj": "attn.c_proj", "gate_proj": None, "up_proj": "mlp.c_fc", "down_proj": "mlp.c_proj"}
# transformers' names under "transformer.", the original checkpoints' without it
GPT2_PREFIXES = {f"{root}{theirs}": ours for root in ("transformer.", "")
                 for theirs, ours in (("wte.", "model.embed_tokens."), ("wpe.", "model.embed_positions."),
                                      ("h.", "model.layers."), ("ln_f.", "model.norm."))} | {"lm_head.": "lm_head."}


def gpt2_keys(d: dict) -> dict:
    """GPT-2's config.json keys as the common ones."""
    out = dict(d)
    for theirs, ours in (("n_embd", "hidden_size"), ("n_layer", "num_hidden_layers"), ("n_head", "num_attention_heads"),
                         ("n_positions", "max_position_embeddings")):
        if theirs in d:
            out.setdefault(ours, d[theirs])
    out["intermediate_size"] = d.get("n_inner") or 4 * out["hidden_size"]
    out.setdefault("tie_word_embeddings", True)
    return out


def gpt2_config(d: dict) -> dict:
    if d.get("scale_attn_by_inverse_layer_idx"):
        raise ValueError(f"{d['architectures'][0]} with scale_attn_by_inverse_layer_idx is not supported")
    out = {"num_key_value_heads": d["num_attention_heads"], "learned_positions": True, "norm_type": "layer",
           "rms_norm_eps": float(d.get("layer_norm_epsilon", 1e-5)),
           "gated_mlp": False, "hidden_act": d.get("activation_function") or "gelu_new", "attention_bias": True,
           "o_proj_bias": True, "mlp_bias": True, "tie_word_embeddings": bool(d.get("tie_word_embeddings", True))}
    if not d.get("scale_attn_weights", True):
        out["attn_scale"] = 1.0
    return out


def gpt_bigcode_config(d: dict) -> dict:
    out = gpt2_config({**d, "activation_function": d.get("activation_function") or "gelu_pytorch_tanh"})
    out["num_key_value_heads"] = 1 if d.get("multi_query", True) else d["num_attention_heads"]
    return out


def gpt2_gguf(get: GGUFGet) -> dict:
    return {"layer_norm_epsilon": float(get("attention.layer_norm_epsilon", 1e-5))}


register(Architecture("GPT2LMHeadModel", gpt2_config, weights=GPT2_WEIGHTS, text_config=gpt2_keys,
                      prefixes=GPT2_PREFIXES, transposed_linears=True, gguf="gpt2", gguf_config=gpt2_gguf,
                      gguf_globals={"position_embd": "model.embed_positions"}))
def gpt_bigcode_gguf(get: GGUFGet) -> dict:
    return {**gpt2_gguf(get), "multi_query": int(get("attention.head_count_kv", 1)) == 1}


register(Architecture("GPTBigCodeForCausalLM", gpt_bigcode_config, weights=GPT2_WEIGHTS, text_config=gpt2_keys,
                      prefixes=GPT2_PREFIXES, gguf="starcoder", gguf_config=gpt_bigcode_gguf,
                      gguf_globals={"position_embd": "model.embed_positions"}))
