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


# llama.cpp's graph skips rotary on every 4th layer whatever the checkpoint said (no GGUF key), and has no window
register(Architecture("SmolLM3ForCausalLM", smollm3_config, gguf="smollm3", gguf_permuted=True,
                      gguf_config=lambda get: {"no_rope_layer_interval": 4}))
