"""Jamba (AI21's Jamba 1.5/1.6 Mini and Large, Jamba Reasoning 3B): Mamba-1 layers (``kvserve.model.mamba.Mamba1``, their
dt, B and C RMS-normed with weights) but every ``attn_layer_period``-th from ``attn_layer_offset``, which attend without
positions; experts every ``expert_layer_period``-th from ``expert_layer_offset`` (the softmax's top-k, not
renormalised), a SiLU-gated MLP elsewhere, each after ``pre_ff_layernorm``; the final norm ``final_layernorm``."""

from kvserve.model.architectures import Architecture, first_of, register


def jamba_config(d: dict) -> dict:
    layers, hidden = d["num_hidden_layers"], d["hidden_size"]
    attends = [i % d.get("attn_layer_period", 8) == d.get("attn_layer_offset", 4) for i in range(layers)]
    experts = first_of(d, "num_experts", "num_local_experts", default=1)
    rank = d.get("mamba_dt_rank") or "auto"
    out = {"mamba_layers": [not a for a in attends], "mamba_version": 1,
           "mamba_inner": int(d.get("mamba_expand", 2) * hidden), "mamba_state_size": int(d.get("mamba_d_state", 16)),
           "mamba_dt_rank": -(-hidden // 16) if rank == "auto" else int(rank),
           "mamba_conv_kernel": int(d.get("mamba_d_conv", 4)), "mamba_conv_bias": bool(d.get("mamba_conv_bias", True)),
           "mamba_proj_bias": bool(d.get("mamba_proj_bias", False)),
           "mamba_bcdt_norm_eps": float(d.get("rms_norm_eps", 1e-6)), "mamba_bcdt_norm_weights": True,
           "rope_layers": [False] * layers}
    if experts > 1:
        period, offset = d.get("expert_layer_period", 2), d.get("expert_layer_offset", 1)
        out.update(num_experts=experts, num_experts_per_tok=d.get("num_experts_per_tok", 2),
                   moe_intermediate_size=d["intermediate_size"], norm_topk_prob=False,
                   moe_layers=[i % period == offset for i in range(layers)])
    return out


register(Architecture("JambaForCausalLM", jamba_config, weights={
    "post_attention_layernorm": "pre_ff_layernorm", "gate_proj": "feed_forward.gate_proj",
    "up_proj": "feed_forward.up_proj", "down_proj": "feed_forward.down_proj", "router": "feed_forward.router",
    "expert": "feed_forward.experts.{e}."},
    prefixes={"model.final_layernorm.": "model.norm.", "model.": "model.", "lm_head.": "lm_head."}))
