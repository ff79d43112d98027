"""RoPE settings as a Hugging Face ``config.json`` gives them (transformers 4's top-level keys or 5's
``rope_parameters``), and YaRN's magnitude factor; torch-free (``ModelConfig`` and the simulator read them)."""

from __future__ import annotations

import math
from typing import Any


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude factor for a context ``scale`` times the original (1 at or below it)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def rope_settings(d: dict[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    """rope_theta and the scaling dict (None for plain RoPE), from transformers 4's top-level keys or
    transformers 5's ``rope_parameters``."""
    rope_theta = d.get("rope_theta")
    rope_scaling = d.get("rope_scaling")
    rope_params = d.get("rope_parameters")
    if isinstance(rope_params, dict):
        if "full_attention" in rope_params:  # Gemma 3 in transformers 5: per layer type
            # (the full layers' None where they do not rotate: Beam's; then the sliding layers')
            rope_params = rope_params["full_attention"] or rope_params.get("sliding_attention") or {}
        rope_theta = rope_theta or rope_params.get("rope_theta")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = dict(rope_params)
    if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
        rope_scaling = None
    return rope_theta, rope_scaling


def local_rope_scaled(d: dict[str, Any]) -> bool:
    """Whether the sliding layers rotate with the full layers' scaling (transformers 5's ``rope_parameters`` per layer
    type, each scaled as it says); a scaling of their own other than the full layers' is refused."""
    params = d.get("rope_parameters")
    if not isinstance(params, dict) or not isinstance(params.get("sliding_attention"), dict):
        return False
    local, full = ({k: v for k, v in (params.get(t) or {}).items() if k != "rope_theta"}
                   for t in ("sliding_attention", "full_attention"))
    if local.get("rope_type", "default") == "default":
        return False
    if local != full:
        raise ValueError("rope_parameters with a sliding_attention scaling other than full_attention's is not "
                         "supported")
    return True
