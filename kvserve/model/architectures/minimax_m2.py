"""MiniMax-M2: Mixtral's experts (``block_sparse_moe``), each scored by its own sigmoid, chosen with a per-expert bias
(``e_score_correction_bias``) and renormalised; q/k RMSNorms over the whole projections; rotary over the first
``rotary_dim`` of each head (``partial_rotary_factor`` in transformers 5's configs). llama.cpp's "minimax-m2" files:
the rotating dims as ``rope.dimension_count``, the scoring function as ``expert_gating_func`` (softmax refused)."""

from kvserve.model.architectures import Architecture, GGUFGet, gguf_rotary_share, partial_rotary, register
from kvserve.model.architectures.mixtral import MIXTRAL_WEIGHTS, mixtral_config


def minimax_m2_config(d: dict) -> dict:
    if (d.get("scoring_func") or "sigmoid") != "sigmoid":
        raise ValueError(f"MiniMaxM2ForCausalLM with scoring_func {d['scoring_func']!r} is not supported (sigmoid)")
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    legacy = d["rotary_dim"] / head_dim if d.get("rotary_dim") else 1.0
    return {**mixtral_config({**d, "sliding_window": None}), "qk_norm": "full", "router_scoring": "sigmoid",
            "selection_bias": True, "partial_rotary_factor": partial_rotary(d, legacy)}


def minimax_m2_gguf(get: GGUFGet) -> dict:
    return {**gguf_rotary_share(get), "scoring_func": {2: "sigmoid"}.get(int(get("expert_gating_func", 2)), "softmax")}


register(Architecture("MiniMaxM2ForCausalLM", minimax_m2_config, weights={
    **MIXTRAL_WEIGHTS, "selection_bias": "block_sparse_moe.e_score_correction_bias"}, gguf="minimax-m2",
    gguf_config=minimax_m2_gguf))
