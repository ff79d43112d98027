"""dots.note 3 (rednote's Dots3NoteForCausalLM; the text model): DeepSeek-V3.2's latent attention and router with
GLM-5's lightning indexer (rotary on interleaved pairs) on the "indexed_attention" layers, and sliding-window layers
(``layer_types``; by default all but the first two and every fourth from the second) of their own latent shapes
(``per_layer_config``, or the released config's ``swa_*`` keys: heads, ranks, head dims), their own RoPE base and no
indexer. Every layer: the latents' norms scaled by sqrt(hidden / rank) (folded into the norm weights at load), an RMSNorm
on the shared rotary key before rotary (``k_rope_only_layernorm``), a sigmoid gate a head on the output (``g_proj``),
the softmax scale 1/sqrt(q.k width) (no YaRN factor); shared experts of ``shared_experts_intermediate_size`` each."""

from typing import Any

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.deepseek_v2 import DEEPSEEK_WEIGHTS
from kvserve.model.architectures.deepseek_v32 import indexed_latent_config
from kvserve.model.config import FULL, SLIDING

INDEXED = "indexed_attention"
SWA_KEYS = ("num_attention_heads", "q_lora_rank", "kv_lora_rank", "head_dim", "qk_nope_head_dim", "v_head_dim")
SWA_DEFAULTS = dict(num_attention_heads=64, q_lora_rank=1024, kv_lora_rank=1024, head_dim=256, qk_nope_head_dim=192,
                    v_head_dim=128)  # transformers' defaults for the released checkpoint's swa_* keys


def layer_kinds(d: dict) -> list[str]:
    """Each layer's "indexed_attention", "full_attention" (no indexer) or "sliding_attention"; the released configs'
    "full_attention" is indexed unless ``use_dsa`` is false."""
    use_dsa = d.get("use_dsa", None if "per_layer_config" in d else True)
    kinds = d.get("layer_types")
    if kinds is None:
        windows = d.get("use_sliding_window", True)
        kinds = [FULL if not windows or i < 2 or i % 4 == 1 else SLIDING for i in range(d["num_hidden_layers"])]
        kinds = [INDEXED if k == FULL and use_dsa is not False else k for k in kinds]
    elif use_dsa is not None:
        old, new = (FULL, INDEXED) if use_dsa else (INDEXED, FULL)
        kinds = [new if k == old else k for k in kinds]
    return list(kinds)


def layer_shape(d: dict, kinds: list[str], i: int) -> dict[str, Any]:
    """Layer ``i``'s attention shape: the model's, or a sliding layer's own (``per_layer_config`` or ``swa_*``)."""
    base = {k: d.get(k) for k in SWA_KEYS}
    base["qk_rope_head_dim"] = d["qk_rope_head_dim"]
    if kinds[i] != SLIDING:
        return base
    per_layer = d.get("per_layer_config") or {}
    own = per_layer.get(str(i), per_layer.get(i))
    if own is None:
        own = {k: d.get(f"swa_{k}", SWA_DEFAULTS[k]) for k in SWA_KEYS}
    shape = {**base, **{k: v for k, v in own.items() if k in SWA_KEYS or k == "qk_rope_head_dim"}}
    if "qk_rope_head_dim" not in own:  # the rest of the head after its own part
        shape["qk_rope_head_dim"] = d.get("swa_qk_rope_head_dim", shape["head_dim"] - shape["qk_nope_head_dim"])
    return shape


def rope_of(d: dict, kinds: list[str]) -> dict[str, Any]:
    """The global layers' RoPE base and scaling, the sliding layers' own base (unscaled)."""
    params = d.get("rope_parameters") or {}
    full = next((params[k] for k in (INDEXED, FULL) if isinstance(params.get(k), dict)), None)
    local = params.get(SLIDING) if isinstance(params.get(SLIDING), dict) else None
    theta = float((full or {}).get("rope_theta") or d.get("rope_theta") or 80_000_000.0)
    scaling = full if full and full.get("rope_type", "default") != "default" else None
    if local and local.get("rope_type", "default") != "default":
        raise ValueError(f"Dots3NoteForCausalLM with a {local['rope_type']!r} rope on its sliding layers is not supported")
    out: dict[str, Any] = {"rope_theta": theta, "rope_scaling": scaling}
    if SLIDING in kinds:
        out["rope_local_theta"] = float((local or {}).get("rope_theta") or d.get("swa_rope_theta") or 50_000.0)
    return out


def dots3_note_config(d: dict) -> dict:
    kinds = layer_kinds(d)
    if INDEXED in kinds and FULL in kinds:
        raise ValueError("Dots3NoteForCausalLM with global layers both with and without an indexer is not supported")
    layers = d["num_hidden_layers"]
    shapes = [layer_shape(d, kinds, i) for i in range(layers)]
    if any(s["qk_rope_head_dim"] != d["qk_rope_head_dim"] for s in shapes):
        raise ValueError("Dots3NoteForCausalLM with sliding layers of another qk_rope_head_dim is not supported")
    if d.get("rope_scaling") or any(isinstance(p, dict) and p.get("rope_type", "default") != "default"
                                    for p in (d.get("rope_parameters") or {}).values()):
        raise ValueError("Dots3NoteForCausalLM with a scaled rope is not supported")
    if d.get("num_key_value_heads") not in (None, d["num_attention_heads"]):
        raise ValueError("Dots3NoteForCausalLM with num_key_value_heads other than num_attention_heads is not supported")
    first_dense, every = d.get("first_k_dense_replace", 1), d.get("moe_layer_freq", 1)
    mlp_types = d.get("mlp_layer_types") or [
        "sparse" if i >= first_dense and (bool(every[i]) if isinstance(every, list) else i % every == 0) else "dense"
        for i in range(layers)]
    window = d.get("sliding_window") or d.get("sliding_window_size") or 512
    out = indexed_latent_config({**d, "mlp_layer_types": mlp_types, "index_n_heads": d.get("index_n_heads", 64)},
                                True, 64)
    nope, rope = d["qk_nope_head_dim"], d["qk_rope_head_dim"]
    shared = d.get("shared_experts_intermediate_size") or d.get("moe_shared_expert_intermediate_size") or 1536
    dims = [(s["q_lora_rank"], s["kv_lora_rank"], s["qk_nope_head_dim"], rope, s["v_head_dim"]) for s in shapes]
    return {**out, **rope_of(d, kinds), "attn_scale": (nope + rope) ** -0.5, "sliding_window": window,
            "layer_types": [SLIDING if k == SLIDING else FULL for k in kinds],
            "index_topk": out["index_topk"] if INDEXED in kinds else 0,
            "latent_rope_key_norm": True, "attn_output_gate": True, "attn_output_gate_per_head": True,
            "shared_expert_intermediate_size": shared * (d.get("n_shared_experts") or 0),
            **per_layer_shapes(dims, shapes, out)}


def per_layer_shapes(dims: list[tuple], shapes: list[dict], out: dict) -> dict[str, Any]:
    """The per-layer latent dims, heads and cache shapes where a layer's differ from the model's."""
    if len(set(dims)) == 1 and len({s["num_attention_heads"] for s in shapes}) == 1:
        return {}
    heads = [s["num_attention_heads"] for s in shapes]
    return {"latent_layer_dims": dims, "attention_heads_per_layer": heads, "layer_kv_heads": heads,
            "layer_head_dims": [max(q[2] + q[3], q[4]) for q in dims]}


def fold_latent_scales(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """The latents' scales sqrt(hidden / rank) into their norms' weights (an RMSNorm's output times a constant: the
    indexer reads q's scaled latent too, as the checkpoint's model does)."""
    for i in range(cfg.num_hidden_layers):
        q_lora, kv_lora = cfg.latent_dims(i)[:2]
        for role, rank in (("self_attn.q_a_layernorm", q_lora), ("self_attn.kv_a_layernorm", kv_lora)):
            name = f"model.layers.{i}.{role}.weight"
            weights[name] = weights[name] * (cfg.hidden_size / rank) ** 0.5
    return weights


register(Architecture("Dots3NoteForCausalLM", dots3_note_config, adjust_weights=fold_latent_scales, weights={
    **DEEPSEEK_WEIGHTS, "attn_gate_proj": "self_attn.g_proj"}))
