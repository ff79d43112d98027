"""Ergo: sandwich norms whose residual adds mix through a learned gate per dim (a = sigmoid(w) on the sublayer's
output, sqrt(1 + a) * exp(-softplus(w) / 2) on the stream), q/k/v in one projection with per-head q/k norms; sliding
layers rotate adjacent pairs, every ``global_attention_every_n_layers``-th attends the whole context without
positions (q and k there times sqrt(``global_attention_scale``): folded into their norms at load); a dense MLP of
relu^2 first (``num_dense_blocks``), then relu^2 experts without a gate, each output RMS-normed by its own weight,
scored by their sigmoids, chosen with a per-expert bias, renormalised, times ``moe_routed_scaling_factor``, beside a
shared expert normed alike. Checkpoints in the training framework's names (``tok_embeddings``, ``layers.{i}.attention.
wqkv``, the router and shared expert stored [in, out], the experts stacked [experts, in, out])."""

from typing import Any

from kvserve.model.architectures import Architecture, StackedExperts, register
from kvserve.model.architectures.beam import sliding_rope
from kvserve.model.config import FULL, SLIDING


def ergo_config(d: dict) -> dict:
    layers = d["num_hidden_layers"]
    every = d.get("global_attention_every_n_layers") or 4
    types = d.get("layer_types") or [SLIDING if (i + 1) % every else FULL for i in range(layers)]
    dense = d.get("num_dense_blocks", 1)
    mlp_types = d.get("mlp_layer_types") or ["dense" if i < dense else "sparse" for i in range(layers)]
    theta, scaling = sliding_rope(d, "ErgoForCausalLM")
    dense_size = d.get("first_dense_intermediate_size") or 0
    scale = d.get("global_attention_scale")
    return {"norm_layout": "sandwich", "residual_mix": "gated", "qk_norm": "head", "hidden_act": "relu2",
            "gated_mlp": False, "head_dim": d["hidden_size"] // d["num_attention_heads"], "rope_interleaved": True,
            "sliding_window": d.get("sliding_window") or d.get("local_attention_window") or None,
            "layer_types": list(types), "rope_layers": [t == SLIDING for t in types],
            "rope_theta": theta or 1e6, "rope_scaling": scaling,
            "intermediate_size": dense_size, "num_experts": d["num_experts"],
            "num_experts_per_tok": d["num_experts_per_tok"], "moe_intermediate_size": d["moe_intermediate_size"],
            "moe_layers": [t == "sparse" for t in mlp_types], "norm_topk_prob": True, "router_scoring": "sigmoid",
            "selection_bias": True, "routed_scale": float(d.get("moe_routed_scaling_factor") or 8 ** 0.5),
            "shared_expert_intermediate_size": d.get("shared_intermediate_size") or 0, "shared_expert_gated": False,
            "expert_out_norm": True, "tie_word_embeddings": False,
            "weight_multipliers": None if scale is None else {"global_qk": float(scale) ** 0.5}}


def ergo_weights(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """The router's and the shared expert's [in, out] matrices as linears' weights; the global layers' q/k scale
    folded into their q and k norms' weights (q and k are scaled right after them: no rotary between)."""
    scale = (cfg.weight_multipliers or {}).get("global_qk")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for name in ("feed_forward.gate_kernel.weight", "feed_forward.shared_up_proj.weight",
                     "feed_forward.shared_down_proj.weight"):
            if p + name in weights:
                weights[p + name] = weights[p + name].t().contiguous()
        if scale is not None and cfg.window(i) is None:
            for name in ("attention.q_norm.weight", "attention.k_norm.weight"):
                if p + name in weights:
                    weights[p + name] = (weights[p + name].float() * scale).to(weights[p + name].dtype)
    return weights


register(Architecture(
    "ErgoForCausalLM", ergo_config, adjust_weights=ergo_weights,
    prefixes={"tok_embeddings.": "model.embed_tokens.", "norm.": "model.norm.", "output.": "lm_head.",
              "layers.": "model.layers."},
    # (tensors stored without a ".weight" that the table names as linears')
    renames={"feed_forward.gate_kernel": "feed_forward.gate_kernel.weight",
             "feed_forward.shared_up_proj": "feed_forward.shared_up_proj.weight",
             "feed_forward.shared_down_proj": "feed_forward.shared_down_proj.weight"},
    weights={"input_layernorm": "attention_norm", "attn_out_norm": "post_attention_norm",
             "post_attention_layernorm": "ffn_norm", "mlp_out_norm": "post_ffn_norm",
             "qkv_proj": "attention.wqkv", "o_proj": "attention.wo", "q_norm": "attention.q_norm",
             "k_norm": "attention.k_norm", "gate_proj": None, "up_proj": "feed_forward.up",
             "down_proj": "feed_forward.down", "router": "feed_forward.gate_kernel",
             "selection_bias": "feed_forward.router_bias", "shared_expert": "feed_forward.shared_",
             "expert_out_norms": "feed_forward.expert_output_norm.scale",
             "shared_out_norm": "feed_forward.shared_expert_output_norm.scale",
             "attn_residual_gate": "post_attention_residual.scale", "mlp_residual_gate": "post_ffn_residual.scale"},
    stacked_experts=StackedExperts(gate_up="feed_forward.up_proj", down="feed_forward.down_proj", interleaved=False,
                                   transposed=True)))
