"""MiniMax-M2: Mixtral's experts (``block_sparse_moe``), each scored by its own sigmoid, chosen with a per-expert bias
(``e_score_correction_bias``) and renormalised; q/k RMSNorms over the whole projections; rotary over the first
``rotary_dim`` of each head (``partial_rotary_factor`` in transformers 5's configs)."""

from kvserve.model.architectures import Architecture, partial_rotary, register
from kvserve.model.architectures.mixtral import MIXTRAL_WEIGHTS, mixtral_config


def minimax_m2_config(d: dict) -> dict:
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    legacy = d["rotary_dim"] / head_dim if d.get("rotary_dim") else 1.0
    return {**mixtral_config({**d, "sliding_window": None}), "qk_norm": "full", "router_scoring": "sigmoid",
            "selection_bias": True, "partial_rotary_factor": partial_rotary(d, legacy)}


register(Architecture("MiniMaxM2ForCausalLM", minimax_m2_config, weights={
    **MIXTRAL_WEIGHTS, "selection_bias": "block_sparse_moe.e_score_correction_bias"}))
