"""Cohere 2 (Command R7B, Command A): Cohere's layers, three sliding-window layers to each global one, and rotary on
the sliding layers only (the global ones attend without positions). llama.cpp's "cohere2" files (its graph fixes
the pattern at four)."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.cohere import cohere_config, cohere_gguf
from kvserve.model.config import FULL, SLIDING


def cohere2_config(d: dict) -> dict:
    pattern = d.get("sliding_window_pattern") or 4
    types = d.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(d["num_hidden_layers"])]
    window = d.get("sliding_window") or None
    # transformers rotates q and k only in a layer that has a window
    return {**cohere_config(d), "sliding_window": window, "layer_types": list(types),
            "rope_layers": [window is not None and t == SLIDING for t in types]}


register(Architecture("Cohere2ForCausalLM", cohere2_config, gguf="cohere2", gguf_config=cohere_gguf))
