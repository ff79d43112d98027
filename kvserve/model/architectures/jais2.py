"""Jais 2: Llama's attention (q/k/v/o biases where ``attention_bias``, the default) with LayerNorms (weights and
biases) and a non-gated MLP of ``hidden_act`` (relu squared) with biases (``mlp_bias``, the default). llama.cpp's
"jais2" files: no activation key (its graph's relu2, so kvserve's default), the biases as the tensors say."""

from kvserve.model.architectures import Architecture, GGUFGet, register


def jais2_config(d: dict) -> dict:
    return {"norm_type": "layer", "rms_norm_eps": float(d.get("layer_norm_eps", 1e-5)), "gated_mlp": False,
            "hidden_act": d.get("hidden_act") or "relu2", "attention_bias": bool(d.get("attention_bias", True)),
            "o_proj_bias": bool(d.get("attention_bias", True)), "mlp_bias": bool(d.get("mlp_bias", True))}


def jais2_gguf(get: GGUFGet) -> dict:
    return {"layer_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5))}


register(Architecture("Jais2ForCausalLM", jais2_config, weights={"gate_proj": None}, gguf="jais2",
                      gguf_config=jais2_gguf))
