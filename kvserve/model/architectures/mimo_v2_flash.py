"""MiMo-V2-Flash (Xiaomi): attention whose values are narrower than its keys (``v_head_dim`` against ``head_dim``:
zero-padded in the cache) and scaled by ``attention_value_scale`` (folded into v_proj at load); "sliding_attention"
layers with twice the K/V heads, a window and a learned sink per head (``attention_sink_bias``); each layer type
rotating a share of each head (``partial_rotary_factor``) by its own ``rope_parameters``; a dense first layer
(``mlp_layer_types``), then DeepSeek-V3's experts without a shared one (sigmoid scores chosen with
``e_score_correction_bias`` from the best ``topk_group`` of ``n_group`` groups). The multi-token-prediction layers
(``model.mtp.``) are not read."""

from typing import Any

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.deepseek_v3 import v3_experts
from kvserve.model.config import FULL, SLIDING


def mimo_v2_flash_config(d: dict) -> dict:
    layers = d["num_hidden_layers"]
    types = list(d.get("layer_types") or [FULL if i == 0 or not (i + 1) % 6 else SLIDING for i in range(layers)])
    mlps = d.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    params = d.get("rope_parameters") or {}
    full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
    if any(p.get("rope_type", "default") != "default" for p in (full, local)):
        raise ValueError("MiMo-V2-Flash's rope_parameters other than the default rotary are not supported")
    kv = d.get("num_key_value_heads") or d["num_attention_heads"]
    sliding = [t == SLIDING for t in types]
    window = d.get("sliding_window") or (d["sliding_window_size"] + 1 if d.get("sliding_window_size") else None)
    out: dict[str, Any] = {
        "head_dim": d.get("head_dim") or 192, "v_head_dim": d.get("v_head_dim") or 128, "layer_types": types,
        "sliding_window": window, "layer_kv_heads": [2 * kv if s else kv for s in sliding],
        "attn_sinks": any(sliding), "sink_layers": sliding, "o_proj_bias": False,
        "partial_rotary_factor": float(full.get("partial_rotary_factor", 0.334)),
        "rope_local_theta": float(local.get("rope_theta", 10000.0)),
        "rope_local_partial_rotary_factor": float(local.get("partial_rotary_factor", 0.334)),
        "weight_multipliers": {"value": float(d.get("attention_value_scale") or 1.0)}}
    if d.get("n_routed_experts"):
        out.update(v3_experts({**d, "n_shared_experts": 0}, [m == "sparse" for m in mlps]))
    return out


def scale_values(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """attention_value_scale folded into v_proj (weight and bias): the values it makes, scaled."""
    scale = (cfg.weight_multipliers or {}).get("value", 1.0)
    if scale == 1.0:
        return weights
    for name in [n for n in weights if ".self_attn.v_proj." in n]:
        weights[name] = (weights[name].float() * scale).to(weights[name].dtype)
    return weights


register(Architecture("MiMoV2FlashForCausalLM", mimo_v2_flash_config, adjust_weights=scale_values, weights={
    "sinks": "self_attn.attention_sink_bias", "selection_bias": "mlp.gate.e_score_correction_bias"}))
