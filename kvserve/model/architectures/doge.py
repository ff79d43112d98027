"""Doge (SmallDoge): Llama's layers with per-head q/k RMSNorms, dynamic mask attention (a bias per key and K/V head
from its values, ``key_bias``: ``kvserve.model.dynamic_mask``) and the stream weighted per channel before each
sublayer's add (``input_residual``, ``post_attention_residual``: ``residual_weights``); a window on every layer where
``sliding_window`` is set. Past ``keep_window_size`` keys transformers keeps each query's top keys by their bias alone,
which no path here runs: the context stops there (``max_position_embeddings`` capped). Refused: the cross-domain MoE
(``is_moe``: transformers' router reads its logits across the tokens of a call, so a prompt's answer depends on how it
is cut into chunks)."""

from kvserve.model.architectures import Architecture, register


def doge_config(d: dict) -> dict:
    if d.get("is_moe"):
        raise ValueError("DogeForCausalLM with is_moe (the cross-domain MoE) is not supported")
    keep = d.get("keep_window_size") or 2048
    return {"qk_norm": "head", "key_bias": True, "residual_weights": True,
            "sliding_window": d.get("sliding_window") or None,
            "max_position_embeddings": min(d.get("max_position_embeddings") or 2048, keep)}


register(Architecture("DogeForCausalLM", doge_config))
