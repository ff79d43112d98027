"""GPT-NeoX (Pythia, GPT-NeoX-20B, RedPajama-INCITE) and GPT-J: LayerNorms with biases, rotary over the first part of
each head (``rotary_pct`` / ``rotary_dim``), attention and a non-gated GELU MLP side by side. GPT-NeoX: a norm each
for attention and the MLP where ``use_parallel_residual`` (else one after the other), q/k/v in one tensor head by head
(``qkv_per_head``), biases everywhere, the LM head ``embed_out``. GPT-J: one norm for both, rotary on interleaved
pairs, no attention biases, an LM head with a bias.
llama.cpp's "gptneox" files: q/k/v as q's rows, then k's, then v's (the Hugging Face loader's layout), the residual's
form as its own key, no rope base (llama.cpp's 10000)."""

from kvserve.model.architectures import Architecture, GGUFGet, first_of, gguf_rotary_share, partial_rotary, register
from kvserve.model.architectures.gpt2 import gpt2_keys


def gpt_neox_config(d: dict) -> dict:
    return {"num_key_value_heads": d["num_attention_heads"], "norm_type": "layer",
            "rms_norm_eps": float(d.get("layer_norm_eps", 1e-5)), "gated_mlp": False,
            "hidden_act": d.get("hidden_act") or "gelu", "attention_bias": bool(d.get("attention_bias", True)),
            "o_proj_bias": bool(d.get("attention_bias", True)), "mlp_bias": True,
            "norm_layout": "parallel_two" if d.get("use_parallel_residual", True) else "pre",
            "partial_rotary_factor": partial_rotary(d, float(d.get("rotary_pct", 0.25))),
            "rope_theta": float(first_of(d, "rotary_emb_base", "rope_theta", default=10000.0))}


def gptj_config(d: dict) -> dict:
    if d.get("tie_word_embeddings"):
        raise ValueError(f"{d['architectures'][0]} with tie_word_embeddings (a tied head beside its bias) is not "
                         "supported")
    head_dim = d["hidden_size"] // d["num_attention_heads"]
    return {"num_key_value_heads": d["num_attention_heads"], "norm_type": "layer",
            "rms_norm_eps": float(d.get("layer_norm_epsilon", 1e-5)), "gated_mlp": False,
            "hidden_act": d.get("activation_function") or "gelu_new", "mlp_bias": True, "norm_layout": "parallel",
            "rope_interleaved": True, "partial_rotary_factor": (d.get("rotary_dim") or head_dim) / head_dim,
            "lm_head_bias": True, "tie_word_embeddings": False}


def gpt_neox_gguf(get: GGUFGet) -> dict:
    return {**gguf_rotary_share(get), "layer_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5)),
            "use_parallel_residual": bool(get("use_parallel_residual", True))}


register(Architecture("GPTNeoXForCausalLM", gpt_neox_config, weights={
    "qkv_proj": "attention.query_key_value", "o_proj": "attention.dense", "gate_proj": None,
    "up_proj": "mlp.dense_h_to_4h", "down_proj": "mlp.dense_4h_to_h"}, qkv_per_head=True,
    prefixes={"gpt_neox.embed_in.": "model.embed_tokens.", "gpt_neox.final_layer_norm.": "model.norm.",
              "gpt_neox.layers.": "model.layers.", "embed_out.": "lm_head."},
    gguf="gptneox", gguf_config=gpt_neox_gguf))
register(Architecture("GPTJForCausalLM", gptj_config,
                      text_config=lambda d: {**gpt2_keys(d), "tie_word_embeddings": bool(d.get("tie_word_embeddings"))},
                      weights={"input_layernorm": "ln_1", "q_proj": "attn.q_proj", "k_proj": "attn.k_proj",
                               "v_proj": "attn.v_proj", "o_proj": "attn.out_proj", "gate_proj": None,
                               "up_proj": "mlp.fc_in", "down_proj": "mlp.fc_out"},
                      prefixes={"transformer.wte.": "model.embed_tokens.", "transformer.h.": "model.layers.",
                                "transformer.ln_f.": "model.norm.", "lm_head.": "lm_head."}))
