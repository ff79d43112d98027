"""Kimi Linear: Kimi delta attention (``kvserve.model.kimi_delta``: the delta rule with a decay per key channel) on
most layers and, on the rest (``layer_types``, or ``linear_attn_config``'s 1-based ``full_attn_layers``), DeepSeek-V3's
latent attention without rotary (``mla_use_nope``: the rotary key's dims shared as they are); DeepSeek-V3's experts
(sigmoid scores with a selection bias, expert groups, a shared expert) from ``first_k_dense_replace`` on, or where
``mlp_layer_types`` says "sparse". The released config.json names its keys Kimi's way (``num_experts_per_token``,
``moe_renormalize``, ``num_expert_group``, ``model_max_length``); transformers' names are read too."""

from kvserve.model.architectures import Architecture, first_of, register
from kvserve.model.architectures.deepseek_v2 import DEEPSEEK_WEIGHTS, dense_first_layers, latent_attention_config
from kvserve.model.architectures.deepseek_v3 import v3_experts


def kimi_layer_types(d: dict, linear: dict) -> list[str]:
    """Each layer's mixer: ``layer_types``, else ``linear_attn_config``'s 1-based lists, else every fourth layer
    attends (from the fifth: transformers' default)."""
    if d.get("layer_types"):
        return list(d["layer_types"])
    n = d["num_hidden_layers"]
    if "full_attn_layers" in linear:
        full = {i - 1 for i in linear["full_attn_layers"]}
        return ["full_attention" if i in full else "linear_attention" for i in range(n)]
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]


def deepseek_names(d: dict) -> dict:
    """``d`` with the expert keys under DeepSeek-V3's names where it gives them Kimi's."""
    renamed = {"n_routed_experts": ("n_routed_experts", "num_experts", "num_local_experts"),
               "num_experts_per_tok": ("num_experts_per_tok", "num_experts_per_token"),
               "n_shared_experts": ("n_shared_experts", "num_shared_experts"),
               "norm_topk_prob": ("norm_topk_prob", "moe_renormalize"), "n_group": ("n_group", "num_expert_group")}
    return {**d, **{ours: first_of(d, *keys) for ours, keys in renamed.items() if first_of(d, *keys) is not None}}


def kimi_linear_config(d: dict) -> dict:
    name = d["architectures"][0]
    if d.get("mla_use_nope") is False:
        raise ValueError(f"{name} with mla_use_nope false (rotary in the latent attention) is not supported")
    if (d.get("moe_router_activation_func") or "sigmoid") != "sigmoid":
        raise ValueError(f"{name} with moe_router_activation_func {d['moe_router_activation_func']!r} is not "
                         "supported (sigmoid)")
    linear = d.get("linear_attn_config") or {}
    kinds = kimi_layer_types(d, linear)
    heads = first_of(linear, "num_heads", default=d.get("linear_num_heads") or 32)
    dim = first_of(linear, "head_dim", default=d.get("linear_head_dim") or 128)
    n = d["num_hidden_layers"]
    out = {**latent_attention_config(d), "rope_layers": [False] * n,
           "max_position_embeddings": first_of(d, "max_position_embeddings", "model_max_length", default=4096),
           "tie_word_embeddings": False,  # (transformers' model keeps lm_head its own whatever the config says)
           "delta_layers": [kind == "linear_attention" for kind in kinds], "delta_rule": "kimi",
           "delta_key_heads": heads, "delta_value_heads": heads, "delta_key_dim": dim, "delta_value_dim": dim,
           "delta_gate_rank": dim,
           "delta_conv_kernel": first_of(linear, "short_conv_kernel_size",
                                         default=d.get("linear_conv_kernel_dim") or 4)}
    return {**out, **sparse_experts(d, dense_first=1)}


def sparse_experts(d: dict, dense_first: int) -> dict:
    """DeepSeek-V3's experts under Kimi's and Ling's key names, on the layers ``mlp_layer_types`` marks "sparse" (else
    after the first ``first_k_dense_replace``, ``dense_first`` where unset); none without routed experts."""
    e = deepseek_names(d)
    if not e.get("n_routed_experts"):
        return {}
    if d.get("mlp_layer_types"):
        moe_layers = [kind == "sparse" for kind in d["mlp_layer_types"]]
    else:
        moe_layers = dense_first_layers({**e, "first_k_dense_replace": e.get("first_k_dense_replace", dense_first)})
    return v3_experts(e, moe_layers)


# the KDA layers' tensors sit under self_attn, as latent attention's do; transformers saves every MLP under
# block_sparse_moe (the released files: the MoE layers'), each expert's gate, down and up as w1, w2 and w3
register(Architecture("KimiLinearForCausalLM", kimi_linear_config, renames={".block_sparse_moe.": ".mlp."}, weights={
    **DEEPSEEK_WEIGHTS, "expert_gate": "w1", "expert_up": "w3", "expert_down": "w2",
    "delta_q": "self_attn.q_proj", "delta_k": "self_attn.k_proj", "delta_v": "self_attn.v_proj",
    "delta_f_a": "self_attn.f_a_proj", "delta_f_b": "self_attn.f_b_proj", "delta_g_a": "self_attn.g_a_proj",
    "delta_g_b": "self_attn.g_b_proj", "delta_b": "self_attn.b_proj", "delta_q_conv": "self_attn.q_conv1d",
    "delta_k_conv": "self_attn.k_conv1d", "delta_v_conv": "self_attn.v_conv1d", "delta_dt_bias": "self_attn.dt_bias",
    "delta_A_log": "self_attn.A_log", "delta_norm": "self_attn.o_norm.weight", "delta_out_proj": "self_attn.o_proj"}))
