"""OLMo 3: OLMo 2's layers, three sliding-window layers to each global one; the sliding layers rotate unscaled
(the rope scaling, where set, is the global layers')."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.exaone4 import layer_types
from kvserve.model.architectures.olmo2 import OLMO2_WEIGHTS
from kvserve.model.config import rope_settings


def olmo3_config(d: dict) -> dict:
    theta, scaling = rope_settings(d)  # the global layers'
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    local = (params.get("sliding_attention") or {}).get("rope_theta") or theta or 10000.0
    return {"norm_layout": "post", "qk_norm": "full", "sliding_window": d.get("sliding_window") or None,
            "layer_types": layer_types(d), "rope_local_theta": float(local) if scaling or local != theta else None}


register(Architecture("Olmo3ForCausalLM", olmo3_config, weights=OLMO2_WEIGHTS))
