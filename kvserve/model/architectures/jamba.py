"""Jamba (AI21's Jamba 1.5/1.6 Mini and Large, Jamba Reasoning 3B): Mamba-1 layers (``kvserve.model.mamba.Mamba1``, their
dt, B and C RMS-normed with weights) but every ``attn_layer_period``-th from ``attn_layer_offset``, which attend without
positions; experts every ``expert_layer_period``-th from ``expert_layer_offset`` (the softmax's top-k, not
renormalised), a SiLU-gated MLP elsewhere, each after ``pre_ff_layernorm``; the final norm ``final_layernorm``."""

from kvserve.model.architectures import Architecture, GGUFGet, first_of, register


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


def every(which: list[bool], what: str) -> tuple[int, int]:
    """(period, offset) of the layers ``which`` marks, one every period from the offset; ValueError where they are not."""
    marked = [i for i, w in enumerate(which) if w]
    if not marked:
        return len(which) + 1, len(which)
    offset = marked[0]
    period = marked[1] - marked[0] if len(marked) > 1 else len(which)
    if [i % period == offset % period and i >= offset for i in range(len(which))] != which or offset >= period:
        raise ValueError(f"the {what} layers {marked} are not one every few layers from an offset, as Jamba's are")
    return period, offset


def jamba_gguf(get: GGUFGet) -> dict:
    """llama.cpp's "jamba" files: the attention layers are those with K/V heads, the MoE ones those with a router; each
    one every few layers from an offset, as the config says it."""
    layers = int(get("block_count"))
    kv = get("attention.head_count_kv")
    attends = [bool(n) for n in kv] if isinstance(kv, list) else [True] * layers
    attn_period, attn_offset = every(attends, "attention")
    mamba = attends.index(False) if False in attends else 0
    out = {"attn_layer_period": attn_period, "attn_layer_offset": attn_offset,
           "num_key_value_heads": max(kv) if isinstance(kv, list) else kv,
           "mamba_expand": int(get("ssm.inner_size")) // int(get("embedding_length")),
           "mamba_d_state": int(get("ssm.state_size")), "mamba_dt_rank": int(get("ssm.time_step_rank")),
           "mamba_d_conv": int(get("ssm.conv_kernel", 4)), "mamba_conv_bias": get.has(f"blk.{mamba}.ssm_conv1d.bias"),
           "mamba_proj_bias": get.has(f"blk.{mamba}.ssm_in.bias")}
    if int(get("expert_count", 1)) > 1:
        period, offset = every([get.has(f"blk.{i}.ffn_gate_inp.weight") for i in range(layers)], "expert")
        out.update(expert_layer_period=period, expert_layer_offset=offset)
    return out


# Mamba-1's x_proj, dt_proj a linear, and Jamba's norms of dt, B and C
JAMBA_GGUF_ROLES = {"ssm_x": "mamba_x_proj", "ssm_dt": "mamba_dt_proj", "ssm_dt_norm": "mamba_dt_norm",
                    "ssm_b_norm": "mamba_b_norm", "ssm_c_norm": "mamba_c_norm"}
register(Architecture("JambaForCausalLM", jamba_config, gguf="jamba", gguf_config=jamba_gguf, gguf_roles=JAMBA_GGUF_ROLES,
                      weights={
    "post_attention_layernorm": "pre_ff_layernorm", "gate_proj": "feed_forward.gate_proj",
    "up_proj": "feed_forward.up_proj", "down_proj": "feed_forward.down_proj", "router": "feed_forward.router",
    "expert": "feed_forward.experts.{e}."},
    prefixes={"model.final_layernorm.": "model.norm.", "model.": "model.", "lm_head.": "lm_head."}))
