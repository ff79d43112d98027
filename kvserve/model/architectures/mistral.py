"""Mistral: Llama whose every layer attends a sliding window (``sliding_window``; none in recent releases)."""

from kvserve.model.architectures import Architecture, register


def mistral_config(d: dict) -> dict:
    return {"sliding_window": d.get("sliding_window") or None}


register(Architecture("MistralForCausalLM", mistral_config))
