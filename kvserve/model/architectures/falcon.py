"""Falcon (7B, 40B, 180B; Falcon-RW): LayerNorms with biases, a non-gated MLP of ``activation`` (GELU), biases on
every linear where ``bias``, tied embeddings, rotary over whole heads or ALiBi (``alibi``: Bloom's slopes, the biases
divided by sqrt(head_dim): ``alibi_scale``). The decoder's two generations:

- the old one (Falcon-7B, Falcon-RW): one KV head where ``multi_query`` (else every head its own), attention and the
  MLP side by side over one norm where ``parallel_attn``, else one after the other (Llama's norms);
- ``new_decoder_architecture`` (Falcon-40B, 180B): ``num_kv_heads`` KV heads, always side by side, over a norm each
  (``ln_attn``, ``ln_mlp``) unless ``num_ln_in_parallel_attn`` is 1.

``query_key_value`` holds q/k/v a KV head's group at a time (its queries, its key, its value), which covers all three
layouts (one group of every query: multi-query; groups of one: head by head); the loader reorders them
(``qkv_per_head``).

llama.cpp's "falcon" files: q/k/v as every q row, then k's, then v's; its graph always runs attention and the MLP side
by side with rotary (read as the new decoder: one KV head is Falcon-7B's multi-query), over attn_norm_2 and attn_norm
where the file has both; the context length 2048 whatever the model's."""

from typing import Any

from kvserve.model.architectures import Architecture, GGUFGet, first_of, register


def falcon_keys(d: dict) -> dict:
    """The old configs' names (``n_embed``, ``n_head``, ``n_layer``, ``n_head_kv``) as transformers reads them."""
    out = {**d, "hidden_size": first_of(d, "hidden_size", "n_embed"),
           "num_attention_heads": first_of(d, "num_attention_heads", "n_head"),
           "num_hidden_layers": first_of(d, "num_hidden_layers", "n_layer")}
    heads = out["num_attention_heads"]
    out["head_dim"] = out["hidden_size"] // heads  # (a property of transformers' config: never its own)
    out["intermediate_size"] = d.get("ffn_hidden_size") or 4 * out["hidden_size"]
    out.setdefault("tie_word_embeddings", True)
    return out


def falcon_config(d: dict) -> dict:
    heads, layers = d["num_attention_heads"], d["num_hidden_layers"]
    new = bool(d.get("new_decoder_architecture"))
    if new:
        kv = first_of(d, "num_kv_heads", "n_head_kv", default=heads)
        layout = "parallel_two" if (d.get("num_ln_in_parallel_attn") or 2) == 2 else "parallel"
    else:
        kv = 1 if d.get("multi_query", True) else heads
        layout = "parallel" if d.get("parallel_attn", True) else "pre"
    bias = bool(d.get("bias", False))
    out = {"num_key_value_heads": kv, "norm_type": "layer", "norm_layout": layout,
           "rms_norm_eps": float(d.get("layer_norm_epsilon") or 1e-5), "gated_mlp": False,
           "hidden_act": d.get("activation") or "gelu", "attention_bias": bias, "o_proj_bias": bias, "mlp_bias": bias}
    if d.get("alibi"):
        out.update(alibi=True, rope_layers=[False] * layers, alibi_scale=d["head_dim"] ** -0.5)
    return out


def falcon_gguf(get: GGUFGet) -> dict:
    """llama.cpp's falcon graph: always the new decoder's parallel layers, attention's input normed by attn_norm_2
    where the file has it (two norms), else the one attn_norm serves both."""
    return {"new_decoder_architecture": True, "num_kv_heads": int(get("attention.head_count_kv", 1)),
            "layer_norm_epsilon": float(get("attention.layer_norm_epsilon", 1e-5)),
            "num_ln_in_parallel_attn": 2 if get.has("blk.0.attn_norm_2.weight") else 1}


def falcon_gguf_norms(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """Falcon-40B's two norms from a GGUF file: its converter names attention's attn_norm_2 and the MLP's attn_norm
    (read as post_attention_layernorm and input_layernorm), so they trade places."""
    if cfg.norm_layout != "parallel_two":
        return weights
    out = dict(weights)
    for i in range(cfg.num_hidden_layers):
        for suffix in ("weight", "bias"):
            a, b = (f"model.layers.{i}.{role}.{suffix}" for role in ("input_layernorm", "post_attention_layernorm"))
            if a in out and b in out:
                out[a], out[b] = out[b], out[a]
    return out


register(Architecture("FalconForCausalLM", falcon_config, text_config=falcon_keys, qkv_per_head=True, weights={
    "qkv_proj": "self_attention.query_key_value", "o_proj": "self_attention.dense", "gate_proj": None,
    "up_proj": "mlp.dense_h_to_4h", "down_proj": "mlp.dense_4h_to_h"},
    prefixes={"transformer.word_embeddings.": "model.embed_tokens.", "transformer.h.": "model.layers.",
              "transformer.ln_f.": "model.norm.", "lm_head.": "lm_head."},
    renames={".ln_attn.": ".input_layernorm.", ".ln_mlp.": ".post_attention_layernorm."},
    gguf="falcon", gguf_config=falcon_gguf, gguf_roles={"attn_norm_2": "post_attention_layernorm"},
    gguf_weights=falcon_gguf_norms))
