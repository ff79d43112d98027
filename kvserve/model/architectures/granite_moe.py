"""Granite 3.x MoE: Granite's four multipliers with a top-k mixture of experts in every layer (softmax over the
chosen logits, so renormalised), the experts stored stacked as linear weights: gate's rows then up's in
``input_linear``, ``output_linear`` the down projections. Granite MoE Shared (Granite 4.0 tiny preview's lineage)
adds a shared expert without a gate, stored as one MLP (``shared_mlp``). llama.cpp writes both as "granitemoe":
gate, up and down per expert tensor, Granite's multiplier keys, the shared expert as ``ffn_*_shexp`` with its
size as ``expert_shared_feed_forward_length``. Granite 4.0's hybrid architecture, its Mamba-2 layers too (see
``granite_moe_hybrid_config``)."""

from kvserve.model.architectures import Architecture, GGUFGet, StackedExperts, first_of, register
from kvserve.model.architectures.granite import granite_config, granite_gguf
from kvserve.model.architectures.mamba2 import mamba2_config


def granite_moe_config(d: dict) -> dict:
    return {**granite_config(d), "num_experts": first_of(d, "num_local_experts", "num_experts"),
            "num_experts_per_tok": d["num_experts_per_tok"], "moe_intermediate_size": d["intermediate_size"],
            "norm_topk_prob": True}


def granite_moe_shared_config(d: dict) -> dict:
    shared = first_of(d, "shared_intermediate_size", "shared_expert_intermediate_size", default=0)
    return {**granite_moe_config(d), "shared_expert_intermediate_size": shared, "shared_expert_gated": False}


def granite_moe_gguf(get: GGUFGet) -> dict:
    """A file with a shared expert is Granite MoE Shared's (one llama.cpp name for both)."""
    shared = int(get("expert_shared_feed_forward_length", 0))
    named = {"architectures": ["GraniteMoeSharedForCausalLM"], "shared_intermediate_size": shared} if shared else {}
    return {**granite_gguf(get), **named}


EXPERTS = StackedExperts(gate_up="block_sparse_moe.input_linear.weight", down="block_sparse_moe.output_linear.weight",
                         interleaved=False, transposed=False)
WEIGHTS = {"router": "block_sparse_moe.router.layer", "shared_expert": "shared_mlp.",
           "shared_gate_up_proj": "input_linear", "shared_down_proj": "output_linear"}

register(Architecture("GraniteMoeForCausalLM", granite_moe_config, weights=WEIGHTS, stacked_experts=EXPERTS,
                      gguf="granitemoe", gguf_permuted=True, gguf_config=granite_moe_gguf))
register(Architecture("GraniteMoeSharedForCausalLM", granite_moe_shared_config, weights=WEIGHTS,
                      stacked_experts=EXPERTS, gguf_permuted=True))


def granite_moe_hybrid_config(d: dict) -> dict:
    """Granite 4.0: layers that attend and Mamba-2 layers (H models: ``layer_types`` "mamba"); micro's
    ``num_local_experts`` 0 makes ``shared_mlp`` the layers' MLP, else Granite MoE Shared's layers; rotary only where
    ``position_embedding_type`` is "rope"."""
    layers = d["num_hidden_layers"]
    kinds = d.get("layer_types") or d.get("layers_block_type") or ["attention"] * layers
    out = {**granite_config(d), **mamba2_config(d, [kind in ("mamba", "linear_attention") for kind in kinds])}
    if d.get("position_embedding_type") != "rope":
        out["rope_layers"] = [False] * layers
    if first_of(d, "num_local_experts", "num_experts", default=0):
        return {**granite_moe_shared_config(d), **out}
    return {**out, "intermediate_size": d["shared_intermediate_size"]}


def granite_hybrid_gguf(get: GGUFGet) -> dict:
    """llama.cpp's "granitehybrid" files (Granite 4.0 H; Bamba's too): the Mamba layers are those without KV heads (a
    count per layer), the Mamba-2 settings under "ssm.", rotary where "rope.scaling.finetuned" says (Bamba), the dense
    MLP's size as the shared expert's length."""
    kv = get("attention.head_count_kv")
    inner, heads = int(get("ssm.inner_size")), int(get("ssm.time_step_rank"))
    out = {**granite_gguf(get), "layer_types": ["mamba" if n == 0 else "attention" for n in kv] if isinstance(kv, list)
           else None, "mamba_n_heads": heads, "mamba_d_head": inner // heads, "mamba_d_ssm": inner,
           "mamba_d_state": int(get("ssm.state_size")), "mamba_n_groups": int(get("ssm.group_count", 1)),
           "mamba_d_conv": int(get("ssm.conv_kernel", 4)),
           "position_embedding_type": "rope" if get("rope.scaling.finetuned") else None}
    shared = int(get("expert_shared_feed_forward_length", 0))
    if not int(get("expert_count", 0)):  # the dense models: their MLP is the "shared" one
        out["shared_intermediate_size"] = shared or int(get("feed_forward_length"))
    return out


register(Architecture("GraniteMoeHybridForCausalLM", granite_moe_hybrid_config, stacked_experts=EXPERTS, weights={
    **WEIGHTS, "gate_up_proj": "shared_mlp.input_linear", "down_proj": "shared_mlp.output_linear"},
    gguf="granitehybrid", gguf_permuted=True, gguf_config=granite_hybrid_gguf))
