"""LFM2-MoE (LFM2-8B-A1B): LFM2's layers (short convolutions and attention) with experts from ``num_dense_layers``
on, each scored by its own sigmoid, chosen with a per-expert bias (``expert_bias``, where ``use_expert_bias``),
renormalised and times ``routed_scaling_factor``; the dense layers' MLP of ``intermediate_size`` as it is.
llama.cpp's "lfm2moe" files."""

from kvserve.model.architectures import Architecture, GGUFGet, register
from kvserve.model.architectures.lfm2 import LFM2_WEIGHTS, lfm2_config, lfm2_gguf


def lfm2_moe_config(d: dict) -> dict:
    dense = d.get("num_dense_layers", 2)
    return {**lfm2_config({**d, "block_auto_adjust_ff_dim": False}), "num_experts": d["num_experts"],
            "num_experts_per_tok": d["num_experts_per_tok"], "moe_intermediate_size": d["moe_intermediate_size"],
            "norm_topk_prob": bool(d.get("norm_topk_prob", True)), "router_scoring": "sigmoid",
            "routed_scale": float(d.get("routed_scaling_factor") or 1.0),
            "selection_bias": bool(d.get("use_expert_bias", True)),
            "moe_layers": [i >= dense for i in range(d["num_hidden_layers"])]}


def lfm2_moe_gguf(get: GGUFGet) -> dict:
    """llama.cpp's "lfm2moe" files: LFM2's keys, the leading dense layers; the converter writes neither a weight norm
    nor a scale (llama.cpp's graph renormalises, unscaled), and always the selection bias (``exp_probs_b``)."""
    return {**lfm2_gguf(get), "num_dense_layers": int(get("leading_dense_block_count", 0)),
            "norm_topk_prob": bool(get("expert_weights_norm", True)),
            "routed_scaling_factor": float(get("expert_weights_scale", 1.0)), "use_expert_bias": True}


register(Architecture("Lfm2MoeForCausalLM", lfm2_moe_config, gguf="lfm2moe", gguf_config=lfm2_moe_gguf,
                      gguf_globals={"token_embd_norm": "model.norm"}, weights={
    **LFM2_WEIGHTS, "router": "feed_forward.gate", "selection_bias": "feed_forward.expert_bias",
    "expert": "feed_forward.experts.{e}.", "expert_gate": "w1", "expert_up": "w3", "expert_down": "w2"},
    prefixes={"model.embedding_norm.": "model.norm.", "model.": "model.", "lm_head.": "lm_head."}))
