"""JetMoE (8B): Llama's norms and rotary around two mixtures of ``num_local_experts`` experts, each token taking its top
``num_experts_per_tok`` (a softmax over the chosen logits) in both: attention's query and output projections
(``attention_experts``: a mixture of attention heads, every expert giving one query head per K/V head over a shared
k/v projection, ``kv_channels`` wide; ``kvserve.model.routed_attention``), and the MLP's experts, stored stacked
[experts, out, in] (``input_linear``: gate's rows then up's; ``output_linear``). Each mixture adds a bias to its
output (``moe_out_bias`` on the MLP's)."""

from kvserve.model.architectures import Architecture, StackedExperts, register

EXPERTS = StackedExperts(gate_up="mlp.input_linear.weight", down="mlp.output_linear.weight", interleaved=False,
                         transposed=False)


def jetmoe_config(d: dict) -> dict:
    experts, top_k = d.get("num_local_experts") or 8, d.get("num_experts_per_tok") or 2
    return {"head_dim": d.get("kv_channels") or 128, "num_attention_heads": d["num_key_value_heads"] * top_k,
            "hidden_act": d.get("activation_function") or "silu", "rms_norm_eps": float(d.get("rms_norm_eps", 1e-6)),
            "attention_experts": experts, "num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": d["intermediate_size"], "norm_topk_prob": True, "moe_out_bias": True,
            "tie_word_embeddings": bool(d.get("tie_word_embeddings", True))}


register(Architecture("JetMoeForCausalLM", jetmoe_config, stacked_experts=EXPERTS,
                      weights={"router": "mlp.router.layer", "attn_router": "self_attention.experts.router.layer.weight",
                               "attn_q_experts": "self_attention.experts.input_linear.weight",
                               "attn_o_experts": "self_attention.experts.output_linear.weight",
                               "attn_o_bias": "self_attention.experts.bias",
                               "attn_kv_proj": "self_attention.kv_proj.weight", "moe_out_bias": "mlp.bias"}))
