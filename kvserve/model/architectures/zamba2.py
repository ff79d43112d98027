"""Zamba2 (Zyphra's Zamba2 1.2B/2.7B/7B): every layer a Mamba-2 layer (pre-norm, its gated norm's epsilon fixed at
1e-5, its convolution with a bias whatever ``use_conv_bias`` says, as transformers builds it; dt at least
``time_step_min`` on prompts and decode steps alike, where transformers' decode step leaves it unclamped); before the
"hybrid" layers' mixers one of ``num_mem_blocks`` shared transformer blocks in turn (``kvserve.model.shared_block``)
reads [stream, embeddings], with heads of 2 x hidden / heads dims scaled as half that, rotary where ``use_mem_rope``, a
gated MLP of ``hidden_act``, and adapters of ``adapter_rank`` per use on gate/up (and on q/k/v where
``use_shared_attention_adapter``). The checkpoints keep a hybrid layer's Mamba part under ``mamba_decoder.``, each block
under its first user's ``shared_transformer.`` (the other users' copies are unread; untied embeddings untie the blocks
too, as transformers builds them: then every use reads its own copy)."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.mamba2 import mamba2_config


def shared_blocks(d: dict, kinds: list[str]) -> int:
    """How many blocks the hybrid layers share: transformers ties the uses of a block only where
    ``tie_word_embeddings`` is set; otherwise each use keeps (and the checkpoint saves) its own copy."""
    return int(d.get("num_mem_blocks", 1)) if d.get("tie_word_embeddings", True) else kinds.count("hybrid")


def zamba2_config(d: dict) -> dict:
    kinds = d.get("layers_block_type") or d.get("layer_types")
    if kinds is None or len(kinds) != d["num_hidden_layers"]:
        raise ValueError("Zamba2 needs layers_block_type, one entry a layer")
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    head_dim = int(d.get("attention_head_dim") or 2 * hidden // heads)
    n = len(kinds)
    mamba = mamba2_config({"mamba_expand": d.get("mamba_expand", 2), "hidden_size": hidden,
                           "mamba_n_heads": d["n_mamba_heads"], "mamba_d_head": d.get("mamba_headdim"),
                           "mamba_n_groups": d.get("mamba_ngroups", 1), "mamba_d_state": d.get("mamba_d_state", 64),
                           "mamba_d_conv": d.get("mamba_d_conv", 4), "use_conv_bias": True,
                           "mamba_proj_bias": d.get("add_bias_linear", False),
                           "time_step_limit": (d.get("time_step_min", 0.001), float("inf"))}, [True] * n)
    rotary = bool(d.get("use_mem_rope", False))
    return {**mamba, "layer_parts": ["mixer"] * n, "mamba_norm_eps": 1e-5, "head_dim": head_dim,
            "attn_scale": (head_dim / 2) ** -0.5, "rope_layers": None if rotary else [False] * n,
            "intermediate_size": d.get("intermediate_size") or 4 * hidden,
            "attention_bias": False, "o_proj_bias": False, "mlp_bias": bool(d.get("add_bias_linear", False)),
            "tie_word_embeddings": d.get("tie_word_embeddings", True),
            "shared_block_layers": [k == "hybrid" for k in kinds], "shared_blocks": shared_blocks(d, kinds),
            "shared_block_adapter_rank": int(d.get("adapter_rank", 128)),
            "shared_block_qkv_adapters": bool(d.get("use_shared_attention_adapter", False))}


register(Architecture("Zamba2ForCausalLM", zamba2_config, weights={
    "shared_block": "shared_transformer.", "shared_block_proj": "linear",
    "post_attention_layernorm": "pre_ff_layernorm", "gate_up_proj": "feed_forward.gate_up_proj",
    "down_proj": "feed_forward.down_proj", "shared_q_adapter": "self_attn.linear_q_adapter_list.{k}",
    "shared_k_adapter": "self_attn.linear_k_adapter_list.{k}",
    "shared_v_adapter": "self_attn.linear_v_adapter_list.{k}",
    "shared_gate_up_adapter": "feed_forward.gate_up_proj_adapter_list.{k}"},
    prefixes={"model.final_layernorm.": "model.norm.", "model.": "model.", "lm_head.": "lm_head."},
    renames={".mamba_decoder.": "."}))
