"""Starcoder2: LayerNorms with biases, a non-gated GELU-tanh MLP (``c_fc``, ``c_proj``), biases on every linear
(``use_bias``), a sliding window on every layer where set."""

from kvserve.model.architectures import Architecture, register


def starcoder2_config(d: dict) -> dict:
    bias = bool(d.get("use_bias", True))
    return {"norm_type": "layer", "gated_mlp": False, "rms_norm_eps": float(d.get("norm_epsilon", 1e-5)),
            "attention_bias": bias, "o_proj_bias": bias, "mlp_bias": bias,
            "hidden_act": d.get("hidden_act") or "gelu_pytorch_tanh", "sliding_window": d.get("sliding_window") or None,
            "tie_word_embeddings": d.get("tie_word_embeddings", True)}


register(Architecture("Starcoder2ForCausalLM", starcoder2_config, weights={
    "gate_proj": None, "up_proj": "mlp.c_fc", "down_proj": "mlp.c_proj"}, gguf="starcoder2",
    gguf_config=lambda get: {"norm_epsilon": float(get("attention.layer_norm_epsilon", 1e-5))}))
