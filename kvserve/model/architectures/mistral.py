"""Mistral: Llama whose every layer attends a sliding window (``sliding_window``; none in recent releases); Ministral
(8B): the window on the layers ``layer_types`` says."""

from kvserve.model.architectures import Architecture, register


def mistral_config(d: dict) -> dict:
    window = d.get("sliding_window") or None
    return {"sliding_window": window, "layer_types": list(d["layer_types"]) if window and d.get("layer_types") else None}


register(Architecture("MistralForCausalLM", mistral_config))
register(Architecture("MinistralForCausalLM", mistral_config))
