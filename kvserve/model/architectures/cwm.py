"""CWM (Code World Model): Llama whose layers attend a sliding window where ``layer_types`` says (by default all but
every fourth), no biases."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.config import FULL, SLIDING


def cwm_config(d: dict) -> dict:
    layers = d["num_hidden_layers"]
    types = d.get("layer_types") or [FULL if i % 4 == 0 else SLIDING for i in range(layers)]
    window = d.get("sliding_window") or None
    return {"sliding_window": window, "layer_types": list(types) if window else None, "attention_bias": False,
            "o_proj_bias": False}


register(Architecture("CwmForCausalLM", cwm_config))
