"""Gemma 3n (text; the multimodal checkpoints read as their text model, the audio and vision towers not read): Gemma 4's
attention (q/k norms, values normed without a weight, a softmax scale of 1, the last ``num_kv_shared_layers`` layers on
earlier layers' K/V) and per-layer inputs, over AltUp's ``altup_num_inputs`` residual streams with LAuReL's low-rank
branch beside attention (``kvserve.model.altup``), and the first layers' MLP gates cut by a gaussian estimate of their
``activation_sparsity_pattern`` quantile."""

from typing import Any

import math

from kvserve.model.architectures import Architecture, GGUFGet, register
from kvserve.model.architectures.gemma2 import GEMMA_WEIGHTS
from kvserve.model.architectures.gemma3_mm import MULTIMODAL_PREFIXES, text_part
from kvserve.model.architectures.gemma4 import GGUF_GLOBALS, GGUF_ROLES, kv_sources
from kvserve.model.config import FULL, SLIDING
from kvserve.model.rope_config import local_rope_scaled


def gemma3n_config(d: dict) -> dict:
    layers, hidden = d["num_hidden_layers"], d["hidden_size"]
    types = list(d.get("layer_types") or [FULL if (i + 1) % 5 == 0 else SLIDING for i in range(layers)])
    inter = d["intermediate_size"]
    sizes = [int(x) for x in inter] if isinstance(inter, (list, tuple)) else [int(inter)] * layers
    sparsity = d.get("activation_sparsity_pattern")
    if sparsity is None:  # (transformers' default: the first 10 layers of a deeper model at 0.95)
        sparse = 10 if layers > 10 else 0
        sparsity = [0.95] * sparse + [0.0] * (layers - sparse)
    elif not isinstance(sparsity, (list, tuple)):
        sparsity = [float(sparsity)] * layers
    params = d.get("rope_parameters") or {}
    local = (params.get(SLIDING) or {}).get("rope_theta", d.get("rope_local_base_freq", 10000.0))
    streams = int(d.get("altup_num_inputs", 4))
    if not 0 <= int(d.get("altup_active_idx", 0)) < streams:
        raise ValueError(f"altup_active_idx {d.get('altup_active_idx')} is not one of the {streams} AltUp streams")
    out: dict[str, Any] = {
        "norm_layout": "sandwich", "hidden_act": d.get("hidden_activation") or "gelu_pytorch_tanh",
        "embed_scale": float(hidden) ** 0.5, "tie_word_embeddings": d.get("tie_word_embeddings", True),
        "head_dim": d.get("head_dim") or 256, "attn_scale": 1.0, "qk_norm": "head", "v_norm": True,
        "o_proj_bias": bool(d.get("attention_bias", False)), "sliding_window": d.get("sliding_window") or None,
        "layer_types": types, "final_logit_softcap": d.get("final_logit_softcapping", 30.0),
        "rope_local_theta": float(local), "rope_local_scaled": local_rope_scaled(d), "rms_norm_eps": d.get("rms_norm_eps", 1e-6),
        "kv_shared_from": kv_sources(types, int(d.get("num_kv_shared_layers", 15) or 0)),
        "layer_intermediate_sizes": sizes, "intermediate_size": max(sizes),
        "per_layer_input_size": int(d.get("hidden_size_per_layer_input", 256) or 0),
        "per_layer_vocab_size": int(d.get("vocab_size_per_layer_input", 262144)),
        "altup_streams": streams, "altup_active": int(d.get("altup_active_idx", 0)),
        "altup_correct_scale": bool(d.get("altup_correct_scale", True)), "laurel_rank": int(d.get("laurel_rank", 64)),
        "activation_sparsity": [float(x) for x in sparsity]}
    return out


def gemma3n_gguf(get: GGUFGet) -> dict:
    """llama.cpp's "gemma3n" files: the layers' kinds one bool each, the MLPs' widths one a layer, each layer's
    sparsity as the gaussian quantile the converter wrote (-inf: none) turned back into its share, the AltUp and
    LAuReL shapes from their keys and tensors."""
    layers = int(get("block_count"))
    sliding = get("attention.sliding_window_pattern") or [True] * layers
    scales = get("activation_sparsity_scale") or [-math.inf] * layers
    out: dict[str, Any] = {
        "layer_types": [SLIDING if s else FULL for s in sliding], "intermediate_size": get("feed_forward_length"),
        "activation_sparsity_pattern": [0.0 if x == -math.inf else round(0.5 * (1 + math.erf(x / 2 ** 0.5)), 6)
                                        for x in scales],
        "altup_num_inputs": int(get("altup.num_inputs", 4)), "altup_active_idx": int(get("altup.active_idx", 0)),
        "altup_correct_scale": get.has("blk.0.altup_correct_scale.weight"),
        "hidden_size_per_layer_input": int(get("embedding_length_per_layer_input", 0)),
        "num_kv_shared_layers": int(get("attention.shared_kv_layers", 0)),
        "rope_parameters": {SLIDING: {"rope_theta": float(get("rope.freq_base_swa", 10000.0))}},
        "laurel_rank": get.shape("blk.0.laurel_l.weight")[0] if get.has("blk.0.laurel_l.weight") else 0}
    if get.has("per_layer_token_embd.weight"):
        out["vocab_size_per_layer_input"] = get.shape("per_layer_token_embd.weight")[0]
    return out


def gemma3n_gguf_weights(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """The converter's stacks of AltUp's projections (into the streams and back) one matrix each again, and its
    output scale without the ".weight" the converter gave it."""
    out = dict(weights)
    for name in ("model.altup_projections", "model.altup_unembed_projections"):
        stacked = out.pop(f"{name}.weight", None)
        for j in range(0 if stacked is None else stacked.shape[0]):
            out[f"{name}.{j}.weight"] = stacked[j]
    for i in range(cfg.num_hidden_layers):
        if (scale := out.pop(f"model.layers.{i}.altup.correct_output_scale.weight", None)) is not None:
            out[f"model.layers.{i}.altup.correct_output_scale"] = scale
    return out


# llama.cpp's names for AltUp's and LAuReL's tensors (the checkpoints' own names under the layer: no role has them)
GGUF_ALTUP = {"altup_router_norm": "altup.router_norm", "altup_router": "altup.modality_router",
              "altup_predict_coef": "altup.prediction_coefs", "altup_correct_coef": "altup.correction_coefs",
              "altup_correct_scale": "altup.correct_output_scale", "laurel_l": "laurel.linear_left",
              "laurel_r": "laurel.linear_right", "laurel_post_norm": "laurel.post_laurel_norm"}
register(Architecture("Gemma3nForCausalLM", gemma3n_config, weights=GEMMA_WEIGHTS, gguf="gemma3n",
                      gguf_config=gemma3n_gguf, gguf_roles={**GGUF_ROLES, **GGUF_ALTUP}, gguf_weights=gemma3n_gguf_weights,
                      gguf_globals={**GGUF_GLOBALS, "altup_proj": "model.altup_projections",
                                    "altup_unembd_proj": "model.altup_unembed_projections"}))
register(Architecture("Gemma3nForConditionalGeneration", gemma3n_config, weights=GEMMA_WEIGHTS, text_config=text_part,
                      prefixes=MULTIMODAL_PREFIXES))
