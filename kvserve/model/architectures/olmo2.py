"""OLMo 2: no norm before a sublayer, one on each sublayer's output; q/k norms over the whole projection.
llama.cpp's "olmo2" files, and OLMo 3's under the same name (a sliding window and its per-layer pattern)."""

from kvserve.model.architectures import Architecture, GGUFGet, register
from kvserve.model.config import FULL, SLIDING

OLMO2_WEIGHTS = {"input_layernorm": None, "post_attention_layernorm": None, "attn_out_norm": "post_attention_layernorm",
                 "mlp_out_norm": "post_feedforward_layernorm"}


def gguf_layer_types(get: GGUFGet) -> list[str] | None:
    """The layers' kinds from llama.cpp's ``attention.sliding_window_pattern`` written as one bool (sliding) a layer
    (EXAONE 4, OLMo 3); None where the file has none."""
    pattern = get("attention.sliding_window_pattern")
    return [SLIDING if p else FULL for p in pattern] if isinstance(pattern, list) and pattern else None


def olmo2_gguf(get: GGUFGet) -> dict:
    """A file with a window is OLMo 3's: its layers' kinds one bool (sliding) each."""
    types = gguf_layer_types(get)
    if not get("attention.sliding_window") or types is None:
        return {}
    return {"architectures": ["Olmo3ForCausalLM"], "layer_types": types}


register(Architecture("Olmo2ForCausalLM", lambda d: {"norm_layout": "post", "qk_norm": "full"}, weights=OLMO2_WEIGHTS,
                      gguf="olmo2", gguf_config=olmo2_gguf))
