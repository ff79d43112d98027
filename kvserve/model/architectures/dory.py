"""Dory: nGPT's layers on the unit sphere (weightless L2 norms: the stream normed, moved towards each sublayer's normed
output at a learned rate per dim, ``lambda_1``/``lambda_2``); attention gated as AFMoE's (``g_proj``, its scale
``s_gate`` folded in), with L2-normed q and k, q scaled per channel after rotary (``sqk``), its output L2-normed before
o_proj; a SwiGLU MLP whose gate and up are scaled per channel (``suv_gate``/``suv_up``, folded in) and whose product is
L2-normed; sliding and full layers, each type rotating by its own base; the logits scaled per token (``logit_scale``,
folded into the LM head). The middle layers run ``n_recurrent_loops`` times (``recurrent_kv_cache_mode`` "per_loop":
each loop unrolled with its own K/V, its layers' weights repeated; "last_loop" refused), each loop from the stream
normed plus the input layers' normed output."""

from typing import Any

from kvserve.model.architectures import Architecture, register
from kvserve.model.config import FULL, SLIDING, rope_settings


def dory_config(d: dict) -> dict:
    if d.get("recurrent_kv_cache_mode", "per_loop") != "per_loop":
        raise ValueError("DoryForCausalLM with recurrent_kv_cache_mode 'last_loop' is not supported")
    types, halve = list(d.get("layer_types") or []), 1
    if "mlp" in types:  # released configs list each layer as an attention block and an mlp block
        types, halve = types[::2], 2
    layers = d["num_hidden_layers"] // halve
    types = types or [FULL if (i + 1) % 4 == 0 else SLIDING for i in range(layers)]
    first, last = d.get("n_input_layers", 8) // halve, d.get("n_output_layers", 8) // halve
    looped = d["n_recurrent_layers"] // halve if d.get("n_recurrent_layers") is not None else layers - first - last
    loops = d.get("n_recurrent_loops", 2)
    if first + looped + last != layers:
        raise ValueError("DoryForCausalLM: n_input_layers + n_recurrent_layers + n_output_layers != num_hidden_layers")
    source = [*range(first), *list(range(first, first + looped)) * loops, *range(first + looped, layers)]
    params = d.get("rope_parameters") or {}
    local = (params.get(SLIDING) or {}).get("rope_theta") if isinstance(params, dict) else None
    theta, scaling = rope_settings(d)
    return {"num_hidden_layers": len(source), "checkpoint_layers": source, "recurrent_loops": (first, looped, loops),
            "layer_types": [types[j] for j in source], "sliding_window": d.get("sliding_window") or None,
            "rope_theta": theta or 1e7, "rope_scaling": scaling, "rope_local_theta": float(local or 1e4),
            "norm_type": "l2", "norm_affine": False, "norm_layout": "sandwich", "residual_mix": "interpolate",
            "rms_norm_eps": 1e-6, "qk_norm": "head", "qk_norm_type": "l2", "query_channel_scale": True,
            "attn_output_gate": True, "attn_sub_norm": True, "mlp_sub_norm": True,
            "weight_multipliers": {"init": float(d.get("initializer_range", 0.0177)),
                                   "alpha": float(d.get("ngpt_alpha_init", 0.05))}}


def folded(cfg: Any) -> dict[str, tuple[int, ...]]:
    """The scales folded into other weights at load (``fold_scales``)."""
    inter, q = cfg.intermediate_size, cfg.num_attention_heads * int(cfg.head_dim)
    out: dict[str, tuple[int, ...]] = {"lm_head.logit_scale": (cfg.vocab_size,)}
    for i in range(cfg.num_hidden_layers):
        out.update({f"model.layers.{i}.mlp.suv_gate": (inter,), f"model.layers.{i}.mlp.suv_up": (inter,),
                    f"model.layers.{i}.self_attn.s_gate": (q,)})
    return out


def fold_scales(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """nGPT's stored scales s (used as s * s_init / initializer_range) folded in: the gate's and the MLP's into their
    projections' rows, the logits' into the LM head's; q's squared and the residual rates scaled, as their parameters
    take them. Each looped layer then given its layer's tensors (read once, for the first loop)."""
    init, alpha = cfg.weight_multipliers["init"], cfg.weight_multipliers["alpha"]
    h, d = cfg.hidden_size, int(cfg.head_dim)

    def scaled(name: str, scale: Any) -> None:
        if name in weights:
            w = weights[name]
            weights[name] = (w.float() * scale.float()[:, None]).to(w.dtype)

    if "lm_head.logit_scale" in weights:
        scaled("lm_head.weight", weights["lm_head.logit_scale"] / init)
    layers = list(cfg.checkpoint_layers)
    for i, source in enumerate(layers):
        first = layers.index(source)
        p = f"model.layers.{first}."
        if i == first and p + "mlp.suv_gate" in weights:
            scaled(p + "mlp.gate_proj.weight", weights[p + "mlp.suv_gate"] * h ** 0.5)
            scaled(p + "mlp.up_proj.weight", weights[p + "mlp.suv_up"] * h ** 0.5)
            scaled(p + "self_attn.g_proj.weight", (weights[p + "self_attn.s_gate"] * (h ** 0.25 / init)).square())
            weights[p + "self_attn.sqk"] = (weights[p + "self_attn.sqk"].float() * (d ** 0.5 / init)).square()
            for name in ("lambda_1", "lambda_2"):
                weights[p + name] = weights[p + name].float() * (alpha / init)
        if i != first:
            for key in [k for k in weights if k.startswith(p)]:
                weights[f"model.layers.{i}." + key[len(p):]] = weights[key]
    return weights


register(Architecture("DoryForCausalLM", dory_config, adjust_weights=fold_scales, folded_weights=folded,
                      prefixes={"backbone.embeddings.": "model.embed_tokens.", "backbone.": "model.",
                                "lm_head.": "lm_head."},
                      weights={"attn_gate_proj": "self_attn.g_proj", "attn_q_scale": "self_attn.sqk",
                               "attn_residual_gate": "lambda_1", "mlp_residual_gate": "lambda_2"}))
