"""Qwen2 / Qwen2.5: Llama with biases on q, k and v; a sliding window on the layers from ``max_window_layers`` on
where ``use_sliding_window`` (off in the released checkpoints, whose ``sliding_window`` is then unused)."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.config import FULL, SLIDING


def qwen2_config(d: dict) -> dict:
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    if not window:
        return {"attention_bias": True, "o_proj_bias": False}
    first = d.get("max_window_layers", d["num_hidden_layers"])
    types = d.get("layer_types") or [SLIDING if i >= first else FULL for i in range(d["num_hidden_layers"])]
    return {"attention_bias": True, "o_proj_bias": False, "sliding_window": window, "layer_types": list(types)}


register(Architecture("Qwen2ForCausalLM", qwen2_config, gguf="qwen2"))
