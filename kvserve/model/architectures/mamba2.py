"""Mamba-2 layers' settings as the hybrid families name them (Granite 4.0 H and Bamba: ``mamba_n_heads``, ``mamba_d_head``
...; Mamba2 and Nemotron-H: ``num_heads``/``mamba_num_heads``, ``head_dim``/``mamba_head_dim`` ...), for
``ModelConfig``'s ``mamba_*`` options (``kvserve.model.mamba``); and Mamba2 itself (Mamba-Codestral): a norm and a Mamba-2
layer in each block, no attention, no MLP (``backbone.embeddings``, ``backbone.layers.{i}.norm`` and ``.mixer``,
``backbone.norm_f``)."""

from kvserve.model.architectures import Architecture, first_of, register


def mamba2_config(d: dict, layers: list[bool]) -> dict:
    """The ``mamba_*`` options for a model whose ``layers`` are Mamba-2 where True (none: {})."""
    if not any(layers):
        return {}
    expand = first_of(d, "mamba_expand", "expand", default=2)
    inner = int(first_of(d, "mamba_d_ssm", default=expand * d["hidden_size"]))  # (Falcon-H1 sets its own)
    heads = int(first_of(d, "mamba_n_heads", "mamba_num_heads", "num_heads"))
    head_dim = first_of(d, "mamba_d_head", "mamba_head_dim", "head_dim", default="auto")
    head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
    if heads * head_dim != inner:
        raise ValueError(f"{heads} Mamba heads of {head_dim} do not make the inner size {inner}")
    limit = d.get("time_step_limit") or (0.0, float("inf"))
    return {"mamba_layers": layers, "mamba_heads": heads, "mamba_head_dim": head_dim,
            "mamba_groups": int(first_of(d, "mamba_n_groups", "n_groups", default=1)),
            "mamba_state_size": int(first_of(d, "mamba_d_state", "ssm_state_size", "state_size")),
            "mamba_conv_kernel": int(first_of(d, "mamba_d_conv", "conv_kernel", default=4)),
            "mamba_conv_bias": bool(first_of(d, "mamba_conv_bias", "use_conv_bias", default=True)),
            "mamba_proj_bias": bool(first_of(d, "mamba_proj_bias", "use_bias", default=False)),
            "mamba_dt_limit": (json_float(limit[0]), json_float(limit[1]))}


def json_float(v) -> float:
    """A float of a config.json: a number, "Infinity", or transformers' {"__float__": "Infinity"} (what it writes for
    non-finite floats)."""
    return float(v["__float__"] if isinstance(v, dict) else v)


def without_attention(d: dict) -> dict:
    """A config with no attention layer, given one nominal head whatever it says (the common parse wants a count;
    nothing attends)."""
    return {**d, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": None}


def mamba2_model_config(d: dict) -> dict:
    layers = d["num_hidden_layers"]
    return {**mamba2_config(d, [True] * layers), "layer_parts": ["mixer"] * layers,
            "rms_norm_eps": float(d.get("layer_norm_epsilon", 1e-5))}


BACKBONE = {"backbone.embeddings.": "model.embed_tokens.", "backbone.norm_f.": "model.norm.", "backbone.": "model.",
            "lm_head.": "lm_head."}
def mamba2_gguf(get) -> dict:
    """llama.cpp's "mamba2" files: the Mamba-2 settings under "ssm." (its time step rank the head count)."""
    inner, heads = int(get("ssm.inner_size")), int(get("ssm.time_step_rank"))
    return {"num_heads": heads, "mamba_d_head": inner // heads, "mamba_d_ssm": inner,
            "state_size": int(get("ssm.state_size")),
            "n_groups": int(get("ssm.group_count", 1)), "conv_kernel": int(get("ssm.conv_kernel", 4)),
            "layer_norm_epsilon": float(get("attention.layer_norm_rms_epsilon", 1e-5))}


register(Architecture("Mamba2ForCausalLM", mamba2_model_config, text_config=without_attention, prefixes=BACKBONE,
                      gguf="mamba2", gguf_config=mamba2_gguf,
                      weights={"input_layernorm": "norm", "mamba_in_proj": "mixer.in_proj",
                               "mamba_out_proj": "mixer.out_proj", "mamba_conv": "mixer.conv1d",
                               "mamba_dt_bias": "mixer.dt_bias", "mamba_A_log": "mixer.A_log", "mamba_D": "mixer.D",
                               "mamba_norm": "mixer.norm.weight"}))


def mamba1_model_config(d: dict) -> dict:
    """Mamba and Falcon Mamba: Mamba-1 blocks alone (``mixer_rms_eps``: Falcon Mamba's norms of dt, B and C)."""
    layers, hidden = d["num_hidden_layers"], d["hidden_size"]
    rank = d.get("time_step_rank") or "auto"
    return {"mamba_layers": [True] * layers, "layer_parts": ["mixer"] * layers, "mamba_version": 1,
            "mamba_inner": int(d.get("intermediate_size") or 2 * hidden), "mamba_state_size": int(d["state_size"]),
            "mamba_dt_rank": -(-hidden // 16) if rank == "auto" else int(rank),
            "mamba_conv_kernel": int(d.get("conv_kernel", 4)), "mamba_conv_bias": bool(d.get("use_conv_bias", True)),
            "mamba_proj_bias": bool(d.get("use_bias", False)),
            "mamba_bcdt_norm_eps": float(d["mixer_rms_eps"]) if d.get("mixer_rms_eps") is not None else None,
            "rms_norm_eps": float(d.get("layer_norm_epsilon", 1e-5)), "intermediate_size": 0}


def mamba1_gguf(get) -> dict:
    """llama.cpp's "mamba" files (Mamba and Falcon Mamba: "ssm.dt_b_c_rms", whose norms take the layers' eps as
    llama.cpp's graph does); the biases the file holds."""
    eps = float(get("attention.layer_norm_rms_epsilon", 1e-5))
    out = {"intermediate_size": int(get("ssm.inner_size")), "state_size": int(get("ssm.state_size")),
           "time_step_rank": int(get("ssm.time_step_rank")), "conv_kernel": int(get("ssm.conv_kernel", 4)),
           "layer_norm_epsilon": eps, "use_conv_bias": get.has("blk.0.ssm_conv1d.bias"),
           "use_bias": get.has("blk.0.ssm_in.bias")}
    if get("ssm.dt_b_c_rms"):
        out.update(architectures=["FalconMambaForCausalLM"], mixer_rms_eps=eps)
    return out


# Mamba-1's x_proj, and dt_proj a linear (Mamba-2's ssm_dt is only dt's bias)
MAMBA1_GGUF_ROLES = {"ssm_x": "mamba_x_proj", "ssm_dt": "mamba_dt_proj"}
MAMBA1_WEIGHTS = {"input_layernorm": "norm", "mamba_in_proj": "mixer.in_proj", "mamba_out_proj": "mixer.out_proj",
                  "mamba_conv": "mixer.conv1d", "mamba_x_proj": "mixer.x_proj", "mamba_dt_proj": "mixer.dt_proj",
                  "mamba_A_log": "mixer.A_log", "mamba_D": "mixer.D"}
register(Architecture("MambaForCausalLM", mamba1_model_config, text_config=without_attention, prefixes=BACKBONE,
                      weights=MAMBA1_WEIGHTS, gguf="mamba", gguf_config=mamba1_gguf, gguf_roles=MAMBA1_GGUF_ROLES))
register(Architecture("FalconMambaForCausalLM", lambda d: {**mamba1_model_config(d), "mamba_bcdt_norm_eps": float(
    d.get("mixer_rms_eps") or 1e-6)}, text_config=without_attention, prefixes=BACKBONE, weights=MAMBA1_WEIGHTS,
    gguf_roles=MAMBA1_GGUF_ROLES))
