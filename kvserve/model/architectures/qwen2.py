"""Qwen2 / Qwen2.5: Llama with biases on q, k and v; a sliding window on the layers from ``max_window_layers`` on
where ``use_sliding_window`` (off in the released checkpoints, whose ``sliding_window`` is then unused)."""

from collections.abc import Callable

from kvserve.model.architectures import Architecture, register
from kvserve.model.config import FULL, SLIDING


def qwen_window(d: dict, sliding: Callable[[int], bool]) -> dict:
    """The window where ``use_sliding_window`` turns it on, on the layers ``layer_types`` names (else those
    ``sliding(i)`` picks, as transformers' config derives them); nothing where it is off."""
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    if not window:
        return {}
    types = d.get("layer_types") or [SLIDING if sliding(i) else FULL for i in range(d["num_hidden_layers"])]
    return {"sliding_window": window, "layer_types": list(types)}


def from_max_window_layers(d: dict) -> Callable[[int], bool]:
    return lambda i: i >= d.get("max_window_layers", 28)  # (transformers' default)


def qwen2_config(d: dict) -> dict:
    return {"attention_bias": True, "o_proj_bias": False, **qwen_window(d, from_max_window_layers(d))}


register(Architecture("Qwen2ForCausalLM", qwen2_config, gguf="qwen2"))
