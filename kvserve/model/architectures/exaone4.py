"""EXAONE 4.0: OLMo 2's layout (a norm on each sublayer's output only) with q/k norms per head; where the config
sets a window, its sliding layers rotate and the global ones attend without positions."""

from kvserve.model.architectures import Architecture, GGUFGet, register
from kvserve.model.architectures.olmo2 import OLMO2_WEIGHTS, gguf_layer_types
from kvserve.model.config import FULL, SLIDING


def layer_types(d: dict) -> list[str]:
    """``layer_types``, else ``sliding_window_pattern``: every n-th layer global (an int), or a string of "L"
    (local) and "G" repeated, the last layer global."""
    layers, pattern = d["num_hidden_layers"], d.get("sliding_window_pattern") or 4
    if d.get("layer_types"):
        return list(d["layer_types"])
    if isinstance(pattern, str):
        return [SLIDING if pattern[i % len(pattern)] == "L" and i < layers - 1 else FULL for i in range(layers)]
    return [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]


def exaone4_config(d: dict) -> dict:
    window = d.get("sliding_window") or None
    types = layer_types(d) if window else None
    return {"norm_layout": "post", "qk_norm": "head", "sliding_window": window, "layer_types": types,
            "rope_layers": None if types is None else [t == SLIDING for t in types]}


def exaone4_gguf(get: GGUFGet) -> dict:
    """llama.cpp's converter writes the layers' kinds as one bool (sliding) per layer."""
    types = gguf_layer_types(get)
    return {} if types is None else {"layer_types": types}


register(Architecture("Exaone4ForCausalLM", exaone4_config, weights=OLMO2_WEIGHTS, gguf="exaone4",
                      gguf_config=exaone4_gguf))
