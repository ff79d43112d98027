"""OPT (125M-66B): learned absolute positions (their table starts 2 rows in: ``position_offset``), no rotary,
LayerNorms with biases before each sublayer, biases on every linear, a non-gated ReLU MLP (``fc1``, ``fc2``), tied
embeddings. Refused: post-norm layers (``do_layer_norm_before`` false: OPT-350M) and embeddings narrower than the
model (``word_embed_proj_dim``)."""

from kvserve.model.architectures import Architecture, register


def opt_config(d: dict) -> dict:
    if not d.get("do_layer_norm_before", True) or d.get("word_embed_proj_dim", d["hidden_size"]) != d["hidden_size"]:
        raise ValueError("OPTForCausalLM with post-norm layers or projected embeddings (OPT-350M) is not supported")
    bias = bool(d.get("enable_bias", True))
    return {"num_key_value_heads": d["num_attention_heads"], "learned_positions": True, "position_offset": 2,
            "norm_type": "layer", "gated_mlp": False,
            "hidden_act": d.get("activation_function") or "relu", "intermediate_size": d["ffn_dim"],
            "attention_bias": bias, "o_proj_bias": bias, "mlp_bias": bias,
            "tie_word_embeddings": bool(d.get("tie_word_embeddings", True))}


register(Architecture("OPTForCausalLM", opt_config, weights={
    "input_layernorm": "self_attn_layer_norm", "post_attention_layernorm": "final_layer_norm",
    "o_proj": "self_attn.out_proj", "gate_proj": None, "up_proj": "fc1", "down_proj": "fc2"},
    prefixes={f"{root}{theirs}": ours for root in ("model.", "") for theirs, ours in
              (("decoder.final_layer_norm.", "model.norm."), ("decoder.embed_positions.", "model.embed_positions."),
               ("decoder.", "model."))} | {"lm_head.": "lm_head."}))
