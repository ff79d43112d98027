"""Gemma 4 (text; the multimodal checkpoints read as their text model): Gemma 3's sandwich layers with norms that scale
by their weight (not 1 + weight), q/k norms and values normed without a weight, a softmax scale of 1, and
- global layers with heads of their own size (``global_head_dim``; fewer K/V heads where ``attention_k_eq_v``, whose
  values are then their keys' projection), rotating a share of each head by "proportional" RoPE;
- the last ``num_kv_shared_layers`` layers attending over the K/V of the last earlier layer of their type;
- per-layer inputs (``hidden_size_per_layer_input``) and a learned scalar on each layer's output;
- experts beside the dense MLP (``enable_moe_block``), the router reading the stream RMS-normed; its scale and each
  expert's are folded into the weights at load (``fold_router_scales``)."""

from dataclasses import replace
from typing import Any

from kvserve.model.architectures import Architecture, GGUFGet, StackedExperts, register
from kvserve.model.architectures.gemma2 import GEMMA_WEIGHTS
from kvserve.model.architectures.gemma3_mm import MULTIMODAL_PREFIXES, text_part
from kvserve.model.config import FULL, SLIDING


def kv_sources(types: list[str], shared: int) -> list[int]:
    """Each layer's K/V source (``kv_shared_from``): itself, or for the last ``shared`` layers the last layer of their
    type before them."""
    layers = len(types)
    if shared >= layers:
        raise ValueError(f"num_kv_shared_layers {shared} leaves no layer of the {layers} to compute K/V")
    first = layers - shared
    if not {types[i] for i in range(first, layers)} <= set(types[:first]):
        raise ValueError("a layer type shares K/V that no earlier layer of its type computes")
    return [i if i < first else max(j for j in range(first) if types[j] == types[i]) for i in range(layers)]


def gemma4_config(d: dict) -> dict:
    layers, hidden = d["num_hidden_layers"], d["hidden_size"]
    if d.get("use_bidirectional_attention") == "all":
        raise ValueError("a Gemma 4 config with use_bidirectional_attention 'all' is an encoder, not a causal LM")
    types = list(d.get("layer_types") or [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(layers)])
    types[-1] = FULL  # (transformers makes the last layer global whatever the config says)
    head_dim, kv_heads = d.get("head_dim") or 256, d.get("num_key_value_heads") or d["num_attention_heads"]
    k_eq_v = bool(d.get("attention_k_eq_v", False))
    overrides = {int(k): v for k, v in (d.get("per_layer_config") or {}).items()}
    if not overrides:  # a config as released: the global layers' shape in two keys
        full = {"head_dim": d.get("global_head_dim", 512)}
        if k_eq_v and d.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = d["num_global_key_value_heads"]
        overrides = {i: full for i, t in enumerate(types) if t == FULL}
    first_shared = layers - int(d.get("num_kv_shared_layers") or 0)
    source = kv_sources(types, int(d.get("num_kv_shared_layers") or 0))
    inter = d["intermediate_size"]
    params = d.get("rope_parameters") or {}
    local = (params.get(SLIDING) or {}).get("rope_theta", 10000.0)
    per_layer = int(d.get("hidden_size_per_layer_input", 256) or 0)
    out: dict[str, Any] = {
        "norm_layout": "sandwich", "hidden_act": d.get("hidden_activation") or "gelu_pytorch_tanh",
        "embed_scale": float(hidden) ** 0.5, "tie_word_embeddings": d.get("tie_word_embeddings", True),
        "head_dim": head_dim, "attn_scale": 1.0, "qk_norm": "head", "v_norm": True,
        "o_proj_bias": bool(d.get("attention_bias", False)),  # (transformers: o_proj biased too)
        "sliding_window": d.get("sliding_window") or None, "layer_types": types,
        "final_logit_softcap": d.get("final_logit_softcapping"), "rope_local_theta": float(local),
        "layer_head_dims": [overrides.get(i, {}).get("head_dim", head_dim) for i in range(layers)],
        "layer_kv_heads": [overrides.get(i, {}).get("num_key_value_heads", kv_heads) for i in range(layers)],
        "k_eq_v_layers": [k_eq_v and t == FULL for t in types], "kv_shared_from": source,
        "layer_intermediate_sizes": [inter * (2 if d.get("use_double_wide_mlp") and i >= first_shared else 1)
                                     for i in range(layers)],
        "per_layer_input_size": per_layer, "per_layer_vocab_size": int(d.get("vocab_size_per_layer_input", 262144)),
        "layer_scalars": True}
    if d.get("enable_moe_block"):
        out.update(num_experts=d["num_experts"], num_experts_per_tok=d["top_k_experts"],
                   moe_intermediate_size=d["moe_intermediate_size"], norm_topk_prob=True, moe_beside_mlp=True)
    return out


def fold_router_scales(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """The router's input scale (a weight per hidden dim, times hidden ** -0.5) folded into its columns, and each
    expert's output scale into its down projection: the same sums, with no tensors of their own."""
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        # (the scales stay: the checkpoint check still finds them; no parameter reads them)
        scale, per_expert = weights.get(f"{p}router.scale"), weights.get(f"{p}router.per_expert_scale")
        if scale is not None and (name := f"{p}router.proj.weight") in weights:
            w = weights[name]
            if hasattr(w, "dequantize"):  # (a GGUF file's, quantized: a scale a column is no block's scale)
                w = w.dequantize()
            weights[name] = (w.float() * (scale.float() * cfg.hidden_size ** -0.5)[None, :]).to(w.dtype)
        if per_expert is not None and (name := f"{p}experts.down_proj") in weights:
            w = weights[name]
            if hasattr(w, "experts"):  # kept quantized (a GGUF file's): each expert's block scales scaled
                weights[name] = replace(w, experts=[e.scaled(s) for e, s in zip(w.experts, per_expert.tolist())])
            else:
                weights[name] = (w.float() * per_expert.float()[:, None, None]).to(w.dtype)
    return weights


def gemma4_gguf(get: GGUFGet) -> dict:
    """The config.json keys of a llama.cpp "gemma4" file: the layers' kinds one bool each, each layer's head size (the
    global and the sliding layers' keys) and K/V heads (a list where they differ), values from keys where a global
    layer has no ``attn_v``; the global layers' "proportional" RoPE as the file's per-pair factors (1 for a pair that
    turns, a huge one for one that does not)."""
    layers = int(get("block_count"))
    sliding = get("attention.sliding_window_pattern") or [True] * layers
    types = [SLIDING if s else FULL for s in sliding]
    kv = get("attention.head_count_kv")
    kv = kv if isinstance(kv, list) else [kv] * layers
    full_dim, local_dim = int(get("attention.key_length")), int(get("attention.key_length_swa", get("attention.key_length")))
    local = next((i for i, t in enumerate(types) if t == SLIDING), 0)
    shared = int(get("attention.shared_kv_layers", 0))
    per_layer = {i: {"head_dim": full_dim, "num_key_value_heads": int(kv[i])} for i, t in enumerate(types) if t == FULL}
    ff = get("feed_forward_length")
    out: dict[str, Any] = {
        "layer_types": types, "head_dim": local_dim, "num_key_value_heads": int(kv[local]), "per_layer_config": per_layer,
        "num_kv_shared_layers": shared, "use_double_wide_mlp": isinstance(ff, list) and len(set(ff)) > 1,
        "attention_k_eq_v": any(t == FULL and i < layers - shared and not get.has(f"blk.{i}.attn_v.weight")
                                for i, t in enumerate(types)),
        "hidden_size_per_layer_input": int(get("embedding_length_per_layer_input", 0)),
        "rope_parameters": {SLIDING: {"rope_theta": float(get("rope.freq_base_swa", 10000.0))}},
        "tie_word_embeddings": not get.has("output.weight")}
    if get.has("per_layer_token_embd.weight"):
        out["vocab_size_per_layer_input"] = get.shape("per_layer_token_embd.weight")[0]
    if get.has("rope_freqs.weight"):
        factors = get.values("rope_freqs.weight")
        turning = sum(f == 1.0 for f in factors)
        if any(f != 1.0 and f < 1e20 for f in factors) or any(f != 1.0 for f in factors[:turning]):
            raise ValueError("gemma4's rope_freqs should turn a leading share of the pairs (1) and hold the rest (1e30)")
        out["rope_scaling"] = {"rope_type": "proportional", "partial_rotary_factor": 2 * turning / full_dim}
    if get("expert_count"):
        out.update(enable_moe_block=True, num_experts=int(get("expert_count")), top_k_experts=int(get("expert_used_count")),
                   moe_intermediate_size=int(get("expert_feed_forward_length")))
    return out


GEMMA4_WEIGHTS = {**GEMMA_WEIGHTS, "router": "router.proj", "router_input_scale": "router.scale",
                  "expert_output_scale": "router.per_expert_scale"}
EXPERTS = StackedExperts(gate_up="experts.gate_up_proj", down="experts.down_proj", interleaved=False, transposed=False)

# llama.cpp's names for what only Gemma 4 has: per-layer inputs, the layer scalar, the norms around the experts, and the
# router's and experts' scales (tensors without a ".weight")
GGUF_ROLES = {"inp_gate": "per_layer_gate", "proj": "per_layer_proj", "post_norm": "per_layer_norm",
              "layer_output_scale": "layer_scalar", "pre_ffw_norm_2": "moe_in_norm", "post_ffw_norm_1": "moe_mlp_out_norm",
              "post_ffw_norm_2": "experts_out_norm", "ffn_gate_inp.scale": "router_input_scale",
              "ffn_down_exps.scale": "expert_output_scale"}
GGUF_GLOBALS = {"per_layer_token_embd": "model.embed_tokens_per_layer",
                "per_layer_model_proj": "model.per_layer_model_projection",
                "per_layer_proj_norm": "model.per_layer_projection_norm"}

register(Architecture("Gemma4ForCausalLM", gemma4_config, weights=GEMMA4_WEIGHTS, stacked_experts=EXPERTS,
                      adjust_weights=fold_router_scales, gguf="gemma4", gguf_config=gemma4_gguf, gguf_roles=GGUF_ROLES,
                      gguf_globals=GGUF_GLOBALS))
register(Architecture("Gemma4ForConditionalGeneration", gemma4_config, weights=GEMMA4_WEIGHTS, stacked_experts=EXPERTS,
                      adjust_weights=fold_router_scales, text_config=text_part, prefixes=MULTIMODAL_PREFIXES))
