"""OpenAI GPT (GPT-1): the original Transformer's post-norm layers (``norm_layout`` "post_add": the residual stream
itself LayerNormed after each sublayer's add) and no norm after the last layer (``final_norm`` false); learned
positions, q/k/v in one Conv1D ``c_attn`` (stored [in, out]: ``transposed_linears``), biases on every linear, a
non-gated MLP of ``afn`` ("gelu": transformers' tanh approximation), tied embeddings; GPT-2's config keys."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.gpt2 import gpt2_keys

ACTIVATIONS = {"gelu": "gelu_new", "swish": "silu", "silu": "silu", "relu": "relu"}  # afn -> hidden_act


def openai_gpt_config(d: dict) -> dict:
    afn = d.get("afn") or "gelu"
    if afn not in ACTIVATIONS:
        raise ValueError(f"OpenAIGPTLMHeadModel with afn {afn} is not supported ({', '.join(ACTIVATIONS)})")
    return {"num_key_value_heads": d["num_attention_heads"], "learned_positions": True, "norm_type": "layer",
            "norm_layout": "post_add", "final_norm": False, "rms_norm_eps": float(d.get("layer_norm_epsilon", 1e-5)),
            "gated_mlp": False, "hidden_act": ACTIVATIONS[afn], "attention_bias": True, "o_proj_bias": True,
            "mlp_bias": True, "tie_word_embeddings": bool(d.get("tie_word_embeddings", True))}


register(Architecture("OpenAIGPTLMHeadModel", openai_gpt_config, text_config=gpt2_keys, transposed_linears=True,
                      weights={"attn_out_norm": "ln_1", "mlp_out_norm": "ln_2", "qkv_proj": "attn.c_attn",
                               "o_proj": "attn.c_proj", "gate_proj": None, "up_proj": "mlp.c_fc",
                               "down_proj": "mlp.c_proj"},
                      prefixes={f"{root}{theirs}": ours for root in ("transformer.", "")
                                for theirs, ours in (("tokens_embed.", "model.embed_tokens."),
                                                     ("positions_embed.", "model.embed_positions."),
                                                     ("h.", "model.layers."))} | {"lm_head.": "lm_head."}))
