"""SmolLM3: Llama whose every ``no_rope_layer_interval``-th layer does not rotate q and k (``no_rope_layers``:
1 where a layer rotates), a sliding window where the config turns it on."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.config import FULL, SLIDING


def smollm3_config(d: dict) -> dict:
    layers, interval = d["num_hidden_layers"], d.get("no_rope_layer_interval") or 4
    rotates = d.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    types = d.get("layer_types") or [SLIDING if not r else FULL for r in rotates]  # the window on NoPE layers
    return {"rope_layers": [bool(r) for r in rotates], "sliding_window": window or None,
            "layer_types": list(types) if window else None}


register(Architecture("SmolLM3ForCausalLM", smollm3_config))
