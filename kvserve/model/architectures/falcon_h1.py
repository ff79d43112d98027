"""Falcon-H1 (0.5B-34B): in every layer attention and a Mamba-2 layer side by side over one norm, their outputs summed
(``ModelConfig.parallel_attention``), then a SiLU-gated MLP (``feed_forward``) after ``pre_ff_layernorm``; the Mamba
output y * silu(z) without a norm unless ``mamba_rms_norm``; its inner size ``mamba_d_ssm``. Its muP multipliers
scale the embeddings and logits (``embed_scale``, ``logit_scale``) and, folded into the weights at load
(``adjust_weights``), the attention's input and keys and output, the Mamba layer's input, each part of its in_proj
(``ssm_multipliers``: z, x, B, C, dt) and its output, and the MLP's gate and down projections."""

from typing import Any

from kvserve.model.architectures import Architecture, GGUFGet, register
from kvserve.model.architectures.mamba2 import mamba2_config


def falcon_h1_config(d: dict) -> dict:
    layers = d["num_hidden_layers"]
    norm = "none" if not d.get("mamba_rms_norm") else "norm_then_gate" if d.get("mamba_norm_before_gate", True) \
        else "gated"
    multipliers = {key: d.get(key) for key in ("key_multiplier", "attention_in_multiplier", "attention_out_multiplier",
                                               "ssm_in_multiplier", "ssm_out_multiplier", "mlp_multipliers",
                                               "ssm_multipliers")}
    return {**mamba2_config(d, [True] * layers), "parallel_attention": True, "mamba_norm": norm,
            "mamba_out_bias": bool(d.get("projectors_bias", False)), "weight_multipliers": multipliers,
            "embed_scale": float(d.get("embedding_multiplier") or 1.0),
            "logit_scale": float(d.get("lm_head_multiplier") or 1.0)}


def fold_multipliers(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """The weights with Falcon-H1's multipliers in them: an input's scale on a linear's weight, an output's on its
    weight and bias (per row for the Mamba in_proj's parts)."""
    m = cfg.weight_multipliers or {}
    one = lambda key: float(m.get(key) if m.get(key) is not None else 1.0)  # noqa: E731
    gate, down = m.get("mlp_multipliers") or (1.0, 1.0)
    inner, state = cfg.mamba_inner, cfg.mamba_groups * cfg.mamba_state_size
    parts = [inner, inner, state, state, cfg.mamba_heads]  # in_proj's rows: z, x, B, C, dt
    segments = list(zip(parts, m.get("ssm_multipliers") or [1.0] * 5))

    def scale(name: str, weight: float, bias: float | None = None, rows: list[tuple[int, float]] | None = None) -> None:
        for suffix, factor in (("weight", weight), ("bias", weight if bias is None else bias)):
            key = f"{name}.{suffix}"
            if key not in weights:
                continue
            t = weights[key].float() * factor
            if rows is not None:  # each part of the rows times its own factor
                first = 0
                for n, f in rows:
                    t[first : first + n] *= f
                    first += n
            weights[key] = t.to(weights[key].dtype)

    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        attn_in = one("attention_in_multiplier")
        scale(p + "self_attn.q_proj", attn_in, 1.0)
        scale(p + "self_attn.k_proj", attn_in * one("key_multiplier"), one("key_multiplier"))
        scale(p + "self_attn.v_proj", attn_in, 1.0)
        scale(p + "self_attn.o_proj", one("attention_out_multiplier"))
        scale(p + "mamba.in_proj", one("ssm_in_multiplier"), 1.0, segments)
        scale(p + "mamba.out_proj", one("ssm_out_multiplier"))
        scale(p + "feed_forward.gate_proj", float(gate))
        scale(p + "feed_forward.down_proj", float(down))
    return weights


def falcon_h1_gguf(get: GGUFGet) -> dict:
    """llama.cpp's "falcon-h1" files: the converter has folded every multiplier into the weights (the embedding's and
    the head's too), so none is left to apply; the Mamba-2 settings under "ssm."; the gated norm where the file has
    one, over y * silu(z) as llama.cpp's graph takes it; the biases the file holds."""
    inner, heads = int(get("ssm.inner_size")), int(get("ssm.time_step_rank"))
    return {"mamba_d_ssm": inner, "mamba_n_heads": heads, "mamba_d_head": inner // heads,
            "mamba_d_state": int(get("ssm.state_size")), "mamba_n_groups": int(get("ssm.group_count", 1)),
            "mamba_d_conv": int(get("ssm.conv_kernel", 4)), "mamba_rms_norm": get.has("blk.0.ssm_norm.weight"),
            "mamba_norm_before_gate": False, "mamba_conv_bias": get.has("blk.0.ssm_conv1d.bias"),
            "mamba_proj_bias": get.has("blk.0.ssm_in.bias"), "projectors_bias": get.has("blk.0.ssm_out.bias"),
            **dict.fromkeys(("key_multiplier", "attention_in_multiplier", "attention_out_multiplier",
                             "ssm_in_multiplier", "ssm_out_multiplier", "embedding_multiplier", "lm_head_multiplier"),
                            1.0), "mlp_multipliers": [1.0, 1.0], "ssm_multipliers": [1.0] * 5}


register(Architecture("FalconH1ForCausalLM", falcon_h1_config, adjust_weights=fold_multipliers, gguf="falcon-h1",
                      gguf_config=falcon_h1_gguf, weights={
    "post_attention_layernorm": "pre_ff_layernorm", "gate_proj": "feed_forward.gate_proj",
    "up_proj": "feed_forward.up_proj", "down_proj": "feed_forward.down_proj"},
    prefixes={"model.final_layernorm.": "model.norm.", "model.": "model.", "lm_head.": "lm_head."}))
