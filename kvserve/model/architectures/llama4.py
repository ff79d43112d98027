"""Llama 4 (Scout, Maverick; text): rotary on interleaved pairs on three layers of four (``no_rope_layers``: 1 rotates),
those attending within chunks of ``attention_chunk_size`` (chunked attention) with q and k RMS-normed without a weight
after rotary (``use_qk_norm``); the layers without rotary attend the whole context, their queries scaled by 1 +
``attn_scale`` log(1 + floor((position + 1) / ``floor_scale``)) (``attn_temperature_tuning``). Experts every
``interleave_moe_layer_step``-th layer (or at ``moe_layers``): the router's top-k each scores by its sigmoid and scales
its expert's input (not its output), beside a shared expert; experts stored stacked [experts, hidden, 2 x inter]; the
dense layers' MLP of ``intermediate_size_mlp``. The multimodal checkpoints are read as their text model."""

from kvserve.model.architectures import Architecture, GGUFGet, StackedExperts, register
from kvserve.model.architectures.gemma3_mm import text_part


def llama4_config(d: dict) -> dict:
    layers = d["num_hidden_layers"]
    every = d.get("no_rope_layer_interval") or 4
    rotary = [bool(r) for r in (d.get("no_rope_layers") or [(i + 1) % every != 0 for i in range(layers)])]
    step = d.get("interleave_moe_layer_step") or 1
    moe = set(d["moe_layers"]) if d.get("moe_layers") is not None else set(range(step - 1, layers, step))
    chunk = d.get("attention_chunk_size")
    kinds = d.get("layer_types") or ["chunked_attention" if r and chunk else "full_attention" for r in rotary]
    out = {"rope_layers": rotary, "rope_interleaved": True, "layer_types": kinds,
           "attention_chunk": chunk if "chunked_attention" in kinds else None,
           "num_experts": d["num_local_experts"], "num_experts_per_tok": d.get("num_experts_per_tok") or 1,
           "moe_intermediate_size": d["intermediate_size"],
           "intermediate_size": d.get("intermediate_size_mlp") or d["intermediate_size"],
           "shared_expert_intermediate_size": d["intermediate_size"], "shared_expert_gated": False,
           "router_scoring": "sigmoid", "norm_topk_prob": False, "moe_scale_inputs": True,
           "moe_layers": [i in moe for i in range(layers)]}
    if d.get("use_qk_norm", True):
        out.update(qk_norm="head", qk_norm_type="unweighted", qk_norm_after_rope=True, qk_norm_layers=rotary)
    if d.get("attn_temperature_tuning", True):
        out.update(query_position_scale=(float(d.get("attn_scale", 0.1)), int(d.get("floor_scale", 8192))),
                   query_scale_offset=1, query_scale_nope=True)
    return out


def llama4_gguf(get: GGUFGet) -> dict:
    """What llama.cpp's graph fixes for "llama4" files: chunks of 8192 on three layers of four (the fourth without rotary)
    with queries scaled past 8192 positions (scale 0.1), unless the file's window is 0 (every layer rotating, whole
    context: MobileLLM's); q/k norms except with 128 experts (Maverick's config turns them off)."""
    experts = int(get("expert_count", 0))
    out = {"intermediate_size_mlp": get("feed_forward_length"), "interleave_moe_layer_step": int(get("interleave_moe_layer_step", 1)),
           "intermediate_size": int(get("expert_feed_forward_length", get("feed_forward_length"))),
           "use_qk_norm": experts != 128}
    if get("attention.sliding_window") == 0:
        return {**out, "no_rope_layer_interval": int(get("block_count")) + 1, "attention_chunk_size": None,
                "attn_temperature_tuning": False}
    return {**out, "no_rope_layer_interval": 4, "attention_chunk_size": 8192, "attn_temperature_tuning": True,
            "attn_scale": 0.1, "floor_scale": 8192}


WEIGHTS = {"gate_proj": "feed_forward.gate_proj", "up_proj": "feed_forward.up_proj",
           "down_proj": "feed_forward.down_proj", "router": "feed_forward.router",
           "shared_expert": "feed_forward.shared_expert."}
EXPERTS = StackedExperts(gate_up="feed_forward.experts.gate_up_proj", down="feed_forward.experts.down_proj",
                         interleaved=False, transposed=True)
register(Architecture("Llama4ForCausalLM", llama4_config, weights=WEIGHTS, stacked_experts=EXPERTS, gguf="llama4",
                      gguf_config=llama4_gguf))
register(Architecture("Llama4ForConditionalGeneration", llama4_config, weights=WEIGHTS, stacked_experts=EXPERTS,
                      text_config=text_part,
                      prefixes={"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                                "model.language_model.": "model.", "lm_head.": "lm_head."}))
