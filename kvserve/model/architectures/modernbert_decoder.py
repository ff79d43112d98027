"""ModernBERT's decoder (ModernBertDecoderForCausalLM: Ettin's decoders): LayerNorms (with a bias where
``norm_bias``) on the embeddings and before each sublayer but the first layer's attention (its input, the normed
embeddings, read as it is: ``first_input_norm``), a gated MLP of act(first half) x second half of ``Wi``, global
layers and sliding ones over ``local_attention`` / 2 keys (``layer_types``, or every ``global_attn_every_n_layers``-th
global), each kind rotating by its own base; after the final norm ModernBERT's prediction head (a dense layer under
``classifier_activation``, a LayerNorm: ``head_transform``) and the LM head ``decoder`` with a bias
(``decoder_bias``) over the embedding's weights (its own copy where the checkpoint stores none, as the decoder's
head with a bias is untied)."""

from typing import Any

from kvserve.model.architectures import Architecture, register
from kvserve.model.config import FULL, SLIDING


def modernbert_decoder_config(d: dict) -> dict:
    layers = d["num_hidden_layers"]
    every = d.get("global_attn_every_n_layers") or 3
    types = d.get("layer_types") or [SLIDING if i % every else FULL for i in range(layers)]
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    # each kind's base: transformers 5's rope_parameters, or the older global_/local_rope_theta (its defaults)
    local, full = params.get("sliding_attention") or {}, params.get("full_attention") or {}
    local_theta = local.get("rope_theta") or d.get("local_rope_theta") or 10000.0
    theta = full.get("rope_theta") or d.get("global_rope_theta") or d.get("rope_theta") or 160000.0
    tied, bias = bool(d.get("tie_word_embeddings", True)), bool(d.get("decoder_bias", True))
    window = (d.get("local_attention") or 0) // 2
    return {"num_key_value_heads": d["num_attention_heads"], "head_dim": d["hidden_size"] // d["num_attention_heads"],
            "norm_type": "layer", "rms_norm_eps": float(d.get("norm_eps", 1e-5)),
            "norm_bias": bool(d.get("norm_bias", False)), "embed_norm": True, "first_input_norm": False,
            "layer_types": list(types), "sliding_window": window or None, "rope_theta": float(theta),
            "rope_local_theta": float(local_theta),
            "rope_local_scaled": local.get("rope_type", "default") != "default" or bool(d.get("rope_scaling")),
            "head_transform": d.get("classifier_activation") or "gelu",
            "head_transform_bias": bool(d.get("classifier_bias", False)),
            "lm_head_bias": bias, "tie_word_embeddings": tied and not bias}


def tied_head(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    if not cfg.tie_word_embeddings:
        weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    return weights


register(Architecture("ModernBertDecoderForCausalLM", modernbert_decoder_config, adjust_weights=tied_head, weights={
    "input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm", "q_proj": "attn.q_proj",
    "k_proj": "attn.k_proj", "v_proj": "attn.v_proj", "o_proj": "attn.Wo", "gate_proj": None, "up_proj": None,
    "gate_up_proj": "mlp.Wi", "down_proj": "mlp.Wo"},
    prefixes={"model.embeddings.tok_embeddings.": "model.embed_tokens.", "model.embeddings.norm.": "model.embed_norm.",
              "model.final_norm.": "model.norm.", "model.": "model.", "lm_head.": "model.head_transform.",
              "decoder.": "lm_head."}))
