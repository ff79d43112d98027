"""Ling 3 (BailingHybrid): Kimi delta attention (``kvserve.model.kimi_delta``) with its forget gate and output gate
projected at full width and the decay bounded where ``kda_safe_gate`` (``kda_lower_bound``), on all but every
``layer_group_size``-th layer (or as ``layer_types`` says); on those, DeepSeek-V3's latent attention (rotary on
interleaved pairs) with a sigmoid gate per head on its output (``g_proj``); DeepSeek-V3's experts (sigmoid scores,
a selection bias, expert groups, a shared expert) after ``first_k_dense_replace`` dense layers, their SwiGLU clipped
where ``expert_swiglu_limit_list`` (``share_expert_swiglu_limit_list``: the shared expert's) gives a layer a limit. The checkpoints name
the embeddings ``word_embeddings``, the mixers ``attention`` and their output ``dense``; the multi-token-prediction
layers after ``num_hidden_layers`` are not read."""

from kvserve.model.architectures import Architecture, first_of, register
from kvserve.model.architectures.deepseek_v2 import DEEPSEEK_WEIGHTS, latent_attention_config
from kvserve.model.architectures.kimi_linear import sparse_experts


def bailing_hybrid_config(d: dict) -> dict:
    granularity = d.get("gated_attention_proj_granularity_type") or "head_wise"
    if granularity != "head_wise":  # (the released remote code's key; transformers gates each head)
        raise ValueError(f"{d['architectures'][0]} with gated_attention_proj_granularity_type {granularity!r} is not "
                         "supported (head_wise)")
    n, every = d["num_hidden_layers"], d.get("layer_group_size") or 6
    kinds = d.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    heads = first_of(d, "linear_num_heads", "num_attention_heads")
    dim = first_of(d, "linear_head_dim", "head_dim", default=128)
    safe = d.get("kda_safe_gate", True)
    out = {**latent_attention_config(d), "attn_output_gate": True, "attn_output_gate_per_head": True,
           "max_position_embeddings": first_of(d, "max_position_embeddings", "model_max_length", default=4096),
           "delta_layers": [kind == "linear_attention" for kind in kinds], "delta_rule": "kimi",
           "delta_key_heads": heads, "delta_value_heads": heads, "delta_key_dim": dim, "delta_value_dim": dim,
           "delta_conv_kernel": first_of(d, "short_conv_kernel_size", "linear_conv_kernel_dim", default=4),
           "delta_decay_bound": float(d.get("kda_lower_bound", -5.0)) if safe else None,
           # the experts' SwiGLU clipped per layer (the released files' late layers; the dense layers' never)
           "expert_clip_layers": first_of(d, "expert_swiglu_limit_list", "swiglu_limits"),
           "shared_expert_clip_layers": first_of(d, "share_expert_swiglu_limit_list", "swiglu_limits_shared"),
           "tie_word_embeddings": False}  # transformers ties no head here, whatever the config says
    return {**out, **sparse_experts(d, dense_first=2)}


register(Architecture(
    "BailingHybridForCausalLM", bailing_hybrid_config,
    renames={"model.word_embeddings.": "model.embed_tokens.", ".attention.": ".self_attn."},
    weights={**DEEPSEEK_WEIGHTS, "selection_bias": "mlp.gate.expert_bias", "o_proj": "self_attn.dense",
             "attn_gate_proj": "self_attn.g_proj", "delta_q": "self_attn.q_proj", "delta_k": "self_attn.k_proj",
             "delta_v": "self_attn.v_proj", "delta_f_a": "self_attn.f_proj", "delta_g_a": "self_attn.g_proj",
             "delta_b": "self_attn.b_proj", "delta_q_conv": "self_attn.q_conv1d", "delta_k_conv": "self_attn.k_conv1d",
             "delta_v_conv": "self_attn.v_conv1d", "delta_dt_bias": "self_attn.dt_bias",
             "delta_A_log": "self_attn.A_log", "delta_norm": "self_attn.o_norm.weight",
             "delta_out_proj": "self_attn.dense"}))
