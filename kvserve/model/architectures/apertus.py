"""Apertus (Swiss AI, 8B/70B): Llama's layers with per-head q/k norms and a non-gated MLP whose activation is xIELU,
with each layer's own parameters (``mlp.act_fn``); its norms named ``attention_layernorm`` and
``feedforward_layernorm``."""

from kvserve.model.architectures import Architecture, register


def apertus_config(d: dict) -> dict:
    return {"qk_norm": "head", "gated_mlp": False, "hidden_act": d.get("hidden_act") or "xielu"}


APERTUS_WEIGHTS = {"input_layernorm": "attention_layernorm", "post_attention_layernorm": "feedforward_layernorm",
                   "gate_proj": None}

register(Architecture("ApertusForCausalLM", apertus_config, weights=APERTUS_WEIGHTS))
