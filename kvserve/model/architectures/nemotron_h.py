"""Nemotron-H (Nemotron-H 8B/47B, Nemotron Nano 2, Nemotron 3 Nano): blocks of one sublayer each (``layer_parts``), a
norm and then a Mamba-2 layer ("M"), attention without rotary ("*"), a squared-ReLU MLP of up and down ("-"), or
experts of up and down ("E": DeepSeek-V3's router, sigmoid scores with a selection bias from the best expert groups,
and a shared expert without a gate). ``layers_block_type`` (or the older ``hybrid_override_pattern``) names the
blocks. The checkpoints' names: ``backbone.`` (or ``model.``) ``embeddings``, ``layers.{i}.norm`` and ``.mixer``,
``norm_f``."""

from kvserve.model.architectures import Architecture, GGUFGet, first_of, register
from kvserve.model.architectures.deepseek_v3 import v3_experts
from kvserve.model.architectures.mamba2 import mamba2_config

# each block kind by its config name, its pattern letter, and transformers 5's name
BLOCKS = {"mamba": "mamba", "M": "mamba", "linear_attention": "mamba", "attention": "attention", "*": "attention",
          "full_attention": "attention", "mlp": "mlp", "-": "mlp", "moe": "moe", "E": "moe"}


def block_kinds(d: dict) -> list[str]:
    return d.get("layers_block_type") or d.get("layer_types") or list(d["hybrid_override_pattern"])


def with_layer_count(d: dict) -> dict:
    """The config with ``num_hidden_layers`` (transformers 5 leaves it out: the block kinds count them)."""
    return {**d, "num_hidden_layers": len(block_kinds(d))}


def nemotron_h_config(d: dict) -> dict:
    kinds = block_kinds(d)
    unknown = sorted({k for k in kinds if k not in BLOCKS})
    if unknown:
        raise ValueError(f"Nemotron-H block kinds {unknown} are not supported (mamba, attention, mlp, moe)")
    kinds = [BLOCKS[k] for k in kinds]
    if d.get("moe_latent_size"):
        raise ValueError("moe_latent_size (experts in a latent space) is not supported")
    n = len(kinds)
    out = {**mamba2_config({**d, "mamba_proj_bias": d.get("use_bias", False)}, [k == "mamba" for k in kinds]),
           "layer_parts": ["mixer" if k in ("mamba", "attention") else "mlp" for k in kinds],
           "rope_layers": [False] * n, "gated_mlp": False, "hidden_act": d.get("mlp_hidden_act") or "relu2",
           "rms_norm_eps": float(first_of(d, "layer_norm_epsilon", "rms_norm_eps", default=1e-5)),
           "attention_bias": False, "o_proj_bias": False, "mlp_bias": bool(d.get("mlp_bias", False)),
           # transformers never ties Nemotron-H's head to the embeddings, whatever tie_word_embeddings says
           "tie_word_embeddings": False}
    if "moe" in kinds:
        experts = v3_experts(d, [k == "moe" for k in kinds])
        # one shared expert whatever n_shared_experts says (as transformers builds it)
        experts["shared_expert_intermediate_size"] = first_of(d, "moe_shared_expert_intermediate_size",
                                                             default=d["moe_intermediate_size"])
        out.update(experts)
    return out


def nemotron_h_gguf(get: GGUFGet) -> dict:
    """llama.cpp's "nemotron_h" and "nemotron_h_moe" files: a block attends where it has K/V heads, is an MLP (experts,
    in a MoE file) where it has a feed-forward length, else Mamba-2; the Mamba-2 settings under "ssm."; the expert
    groups all eligible (the file names no count to choose from them)."""
    layers = int(get("block_count")) - int(get("nextn_predict_layers", 0))
    kv, ff = get("attention.head_count_kv"), get("feed_forward_length")
    kv, ff = (x if isinstance(x, list) else [x] * layers for x in (kv, ff))
    experts = int(get("expert_count", 0))
    kinds = ["attention" if kv[i] else ("moe" if experts else "mlp") if ff[i] else "mamba" for i in range(layers)]
    first_mamba = kinds.index("mamba") if "mamba" in kinds else 0
    inner, heads = int(get("ssm.inner_size")), int(get("ssm.time_step_rank"))
    out = {"layers_block_type": kinds, "num_hidden_layers": layers, "mamba_num_heads": heads,
           "mamba_head_dim": inner // heads, "mamba_d_ssm": inner, "n_groups": int(get("ssm.group_count", 1)),
           "ssm_state_size": int(get("ssm.state_size")), "conv_kernel": int(get("ssm.conv_kernel", 4)),
           "use_bias": get.has(f"blk.{first_mamba}.ssm_in.bias"),
           "use_conv_bias": get.has(f"blk.{first_mamba}.ssm_conv1d.bias"), "intermediate_size": max(ff[:layers])}
    if experts:
        groups = int(get("expert_group_count", 1))
        out.update(n_routed_experts=experts, moe_intermediate_size=int(get("expert_feed_forward_length")),
                   moe_shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0)),
                   n_group=groups, topk_group=int(get("expert_group_used_count", groups)),
                   norm_topk_prob=bool(get("expert_weights_norm", True)),
                   routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
                   n_shared_experts=int(get("expert_shared_count", 1)))
    return out


register(Architecture(
    "NemotronHForCausalLM", nemotron_h_config, text_config=with_layer_count, gguf="nemotron_h",
    gguf_also=("nemotron_h_moe",), gguf_config=nemotron_h_gguf,
    weights={"input_layernorm": "norm", "post_attention_layernorm": "norm",
             "mamba_in_proj": "mixer.in_proj", "mamba_out_proj": "mixer.out_proj", "mamba_conv": "mixer.conv1d",
             "mamba_dt_bias": "mixer.dt_bias", "mamba_A_log": "mixer.A_log", "mamba_D": "mixer.D",
             "mamba_norm": "mixer.norm.weight",
             "q_proj": "mixer.q_proj", "k_proj": "mixer.k_proj", "v_proj": "mixer.v_proj", "o_proj": "mixer.o_proj",
             "up_proj": "mixer.up_proj", "down_proj": "mixer.down_proj", "router": "mixer.gate",
             "selection_bias": "mixer.gate.e_score_correction_bias", "expert": "mixer.experts.{e}.",
             "shared_expert": "mixer.shared_experts."},
    prefixes={"backbone.embeddings.": "model.embed_tokens.", "backbone.norm_f.": "model.norm.", "backbone.": "model.",
              "model.embeddings.": "model.embed_tokens.", "model.norm_f.": "model.norm.", "model.": "model.",
              "lm_head.": "lm_head."}))
