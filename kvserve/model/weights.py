"""Which checkpoint tensors make each of the decoder's parameters: one table, from the architecture's names.

``weight_sources(cfg)`` maps every parameter of ``kvserve.model.decoder.CausalLM`` to the Hugging Face
tensors (name, shape) stacked along their first dimension to make it (q/k/v into one GEMM, gate/up into
another; one tensor where the checkpoint already stacks them). The loaders read the names it lists,
``expected_weight_shapes`` checks a checkpoint against it, ``load_weights`` copies by it and
``linear_sources`` is what the quantized layers fuse. Torch-free.
"""

from __future__ import annotations

from typing import Any

from kvserve.model.architectures import Architecture, get_architecture
from kvserve.model.config import ModelConfig

Source = tuple[str, tuple[int, ...]]  # a checkpoint tensor's name and shape
# the decoder's linear modules (last part of their path; q_b and kv_b: latent attention's expansions; in_proj and
# out_proj: a short convolution's or a Mamba layer's)
LINEARS = ("qkv", "o_proj", "gate_up", "down", "q_b", "kv_b", "in_proj", "out_proj")


def weight_sources(cfg: ModelConfig) -> dict[str, list[Source]]:
    """Our parameter path -> the checkpoint tensors stacked to make it."""
    arch = get_architecture(cfg.architecture)
    h = cfg.hidden_size
    out: dict[str, list[Source]] = {"embed_tokens.weight": [("model.embed_tokens.weight", (cfg.vocab_size, h))]}
    if cfg.learned_positions:
        rows = cfg.max_position_embeddings + cfg.position_offset
        out["embed_positions.weight"] = [("model.embed_positions.weight", (rows, h))]
    if cfg.embed_norm:
        for suffix in ("weight", "bias") if cfg.norm_type == "layer" and cfg.norm_bias else ("weight",):
            out[f"embed_norm.{suffix}"] = [(f"model.embed_norm.{suffix}", (h,))]

    def linear(dst: str, prefix: str, parts: list[tuple[str, int]], fused: str | None, cols: int, bias: bool) -> None:
        """``dst``.weight (and .bias) from the stacked tensor ``fused`` when the checkpoint has one, else
        from the ``parts`` (role, rows)."""
        names = [(fused, sum(r for _, r in parts))] if fused else [(arch.weight_name(role), r) for role, r in parts]
        for suffix, shape in (("weight", lambda r: (r, cols)), ("bias", lambda r: (r,)))[: 2 if bias else 1]:
            out[f"{dst}.{suffix}"] = [(f"{prefix}{name}.{suffix}", shape(r)) for name, r in names]

    norm_suffixes = ("weight", "bias") if cfg.norm_type == "layer" and cfg.norm_bias else ("weight",)
    if not cfg.norm_affine:
        norm_suffixes = ()
    for i in range(cfg.num_hidden_layers):
        p, dst = f"model.layers.{i}.", f"layers.{i}."
        for role in cfg.layer_norm_roles(i):
            name = arch.weight_name(role)
            if name is not None:
                for suffix in norm_suffixes:
                    out[f"{dst}{role}.{suffix}"] = [(f"{p}{name}.{suffix}", (h,))]
        if not cfg.has_mixer(i):
            pass
        elif cfg.is_mamba(i) and cfg.parallel_attention:
            attention(out, arch, cfg, dst + "self_attn.attn.", p, linear, i)
            mamba(out, arch, cfg, dst + "self_attn.mamba.", p, linear)
        elif cfg.is_mamba(i):
            mamba(out, arch, cfg, dst + "self_attn.", p, linear)
        elif cfg.is_delta(i):
            gated_delta(out, arch, cfg, dst + "self_attn.", p, linear)
        elif cfg.is_conv(i):
            short_conv(out, arch, cfg, dst + "self_attn.", p, linear)
        elif cfg.kv_lora_rank:
            latent_attention(out, arch, cfg, dst + "self_attn.", p, linear)
        else:
            attention(out, arch, cfg, dst + "self_attn.", p, linear, i)
        if not cfg.has_mlp(i):
            continue
        if not cfg.is_moe(i):
            mlp(out, arch, dst + "mlp.", p, "", cfg.intermediate_size, h, cfg.mlp_bias, cfg.gated_mlp)
            if cfg.hidden_act == "xielu":  # the activation's own parameters
                for name, shape in (("alpha_p", (1,)), ("alpha_n", (1,)), ("beta", ()), ("eps", ())):
                    out[f"{dst}mlp.act.{name}"] = [(f"{p}{arch.weight_name('act_fn')}.{name}", shape)]
            continue
        out[f"{dst}mlp.router.weight"] = [(f"{p}{arch.weight_name('router')}.weight", (cfg.num_experts, h))]
        if cfg.router_bias:
            out[f"{dst}mlp.router.bias"] = [(f"{p}{arch.weight_name('router')}.bias", (cfg.num_experts,))]
        if cfg.selection_bias:
            out[f"{dst}mlp.selection_bias"] = [(f"{p}{arch.weight_name('selection_bias')}", (1, cfg.num_experts))]
        for e in range(cfg.num_experts):
            if arch.stacked_experts is not None:  # the names unstack_experts gives each expert's cut
                mlp(out, arch, f"{dst}mlp.experts.{e}.", f"{p}{UNSTACKED.format(e=e)}", "unstacked_",
                    cfg.moe_intermediate_size, h, cfg.expert_bias, cfg.gated_mlp)
                continue
            mlp(out, arch, f"{dst}mlp.experts.{e}.", p + str(arch.weight_name("expert")).format(e=e), "expert_",
                cfg.moe_intermediate_size, h, cfg.expert_bias, cfg.gated_mlp)
        if cfg.shared_expert_intermediate_size:
            mlp(out, arch, dst + "mlp.shared.", p + str(arch.weight_name("shared_expert")), "shared_",
                cfg.shared_expert_intermediate_size, h, False, cfg.gated_mlp)
            if cfg.shared_expert_gated:
                out[f"{dst}mlp.shared_gate.weight"] = [(f"{p}{arch.weight_name('shared_expert_gate')}.weight", (1, h))]
    for suffix in norm_suffixes:
        out[f"norm.{suffix}"] = [(f"model.norm.{suffix}", (h,))]
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = [("lm_head.weight", (cfg.vocab_size, h))]
        if cfg.lm_head_bias:
            out["lm_head.bias"] = [("lm_head.bias", (cfg.vocab_size,))]
    return out


def attention(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, prefix: str,
              linear: Any, layer: int) -> None:
    """Attention's weights (``kvserve.model.attention``): q/k/v in one GEMM, o_proj, the q/k norms (per head or over
    the whole projection; LayerNorms: ``head_norms``) and the sinks."""
    h, d = cfg.hidden_size, int(cfg.head_dim or 0)
    q_rows, kv_rows = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    gated = 2 if cfg.attn_output_gate else 1  # q_proj's rows: q's, then the output gate's (standard_layout)
    linear(dst + "qkv", prefix, [("q_proj", gated * q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)],
           arch.weight_name("qkv_proj"), h, cfg.attention_bias)
    linear(dst + "o_proj", prefix, [("o_proj", h)], None, q_rows, cfg.o_proj_bias)
    if not cfg.has_qk_norm(layer) or cfg.qk_norm_type == "unweighted":
        pass
    elif cfg.qk_norm_type == "layer":
        head_norms(out, arch, cfg, dst, prefix)
    else:
        full = cfg.qk_norm == "full"
        for role, rows in (("q_norm", q_rows), ("k_norm", kv_rows)):
            out[f"{dst}{role}.weight"] = [(f"{prefix}{arch.weight_name(role)}.weight", (rows if full else d,))]
    if cfg.attn_sinks:
        out[f"{dst}sinks"] = [(f"{prefix}{arch.weight_name('sinks')}", (cfg.num_attention_heads,))]


def head_norms(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, prefix: str) -> None:
    """Per-head q/k LayerNorms (``layers.HeadLayerNorm``): a weight [heads, head_dim] in one tensor, or in one a head
    where the architecture's name has "{h}" (StableLM's), or one [head_dim] the heads share; a bias alike."""
    d = int(cfg.head_dim or 0)
    suffixes = ("weight", "bias") if cfg.qk_norm_bias else ("weight",)
    for role, heads in (("q_norm", cfg.num_attention_heads), ("k_norm", cfg.num_key_value_heads)):
        name = str(arch.weight_name(role))
        for suffix in suffixes:
            if not cfg.qk_norm_per_head:
                parts = [(f"{prefix}{name}.{suffix}", (d,))]
            elif "{h}" in name:
                parts = [(f"{prefix}{name.format(h=h)}.{suffix}", (1, d)) for h in range(heads)]
            else:
                parts = [(f"{prefix}{name}.{suffix}", (heads, d))]
            out[f"{dst}{role}.{suffix}"] = parts


def short_conv(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, prefix: str,
               linear: Any) -> None:
    """A short convolution's weights (``kvserve.model.short_conv``): in_proj (B, C and x), out_proj, and the
    depthwise kernel [channels, taps] (stored [channels, 1, taps]: viewed so at the checkpoint check)."""
    h = cfg.hidden_size
    linear(dst + "in_proj", prefix, [("conv_in_proj", 3 * h)], None, h, cfg.conv_bias)
    linear(dst + "out_proj", prefix, [("conv_out_proj", h)], None, h, cfg.conv_bias)
    kernel = arch.weight_name("conv_kernel")
    out[f"{dst}kernel"] = [(f"{prefix}{kernel}.weight", (h, cfg.conv_kernel))]
    if cfg.conv_bias:
        out[f"{dst}bias"] = [(f"{prefix}{kernel}.bias", (h,))]


def mamba(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, prefix: str,
          linear: Any) -> None:
    """A Mamba-2 layer's weights (``kvserve.model.mamba``): in_proj (z, x, B, C, dt), the depthwise kernel [channels,
    taps] (stored [channels, 1, taps]) and its bias, dt's bias, A's log, D, the gated norm's weight, out_proj."""
    if cfg.mamba_version == 1:
        return mamba1(out, arch, cfg, dst, prefix, linear)
    h, inner, heads = cfg.hidden_size, cfg.mamba_inner, cfg.mamba_heads
    channels = inner + 2 * cfg.mamba_groups * cfg.mamba_state_size
    linear(dst + "in_proj", prefix, [("mamba_in_proj", inner + channels + heads)], None, h, cfg.mamba_proj_bias)
    out_bias = cfg.mamba_proj_bias if cfg.mamba_out_bias is None else cfg.mamba_out_bias
    linear(dst + "out_proj", prefix, [("mamba_out_proj", h)], None, inner, out_bias)
    conv = arch.weight_name("mamba_conv")
    out[f"{dst}kernel"] = [(f"{prefix}{conv}.weight", (channels, cfg.mamba_conv_kernel))]
    if cfg.mamba_conv_bias:
        out[f"{dst}conv_bias"] = [(f"{prefix}{conv}.bias", (channels,))]
    params = [("dt_bias", "mamba_dt_bias", heads), ("A_log", "mamba_A_log", heads), ("D", "mamba_D", heads)]
    if cfg.mamba_norm != "none":
        params.append(("norm_weight", "mamba_norm", inner))
    for ours, role, rows in params:
        name = arch.weight_name(role)
        out[dst + ours] = [(f"{prefix}{name}", (rows,))]


def mamba1(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, prefix: str,
           linear: Any) -> None:
    """A Mamba-1 layer's weights (``kvserve.model.mamba.Mamba1``): in_proj (x, z), the depthwise kernel over x and its
    bias, x_proj (dt's low rank, B, C), dt_proj (with its bias), A's log [inner, state], D, out_proj."""
    h, inner, n, rank = cfg.hidden_size, cfg.mamba_inner, cfg.mamba_state_size, cfg.mamba_dt_rank
    linear(dst + "in_proj", prefix, [("mamba_in_proj", 2 * inner)], None, h, cfg.mamba_proj_bias)
    linear(dst + "out_proj", prefix, [("mamba_out_proj", h)], None, inner, cfg.mamba_proj_bias)
    linear(dst + "x_proj", prefix, [("mamba_x_proj", rank + 2 * n)], None, inner, False)
    linear(dst + "dt_proj", prefix, [("mamba_dt_proj", inner)], None, rank, True)
    conv = arch.weight_name("mamba_conv")
    out[f"{dst}kernel"] = [(f"{prefix}{conv}.weight", (inner, cfg.mamba_conv_kernel))]
    if cfg.mamba_conv_bias:
        out[f"{dst}conv_bias"] = [(f"{prefix}{conv}.bias", (inner,))]
    out[dst + "A_log"] = [(f"{prefix}{arch.weight_name('mamba_A_log')}", (inner, n))]
    out[dst + "D"] = [(f"{prefix}{arch.weight_name('mamba_D')}", (inner,))]


def gated_delta(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, prefix: str,
                linear: Any) -> None:
    """A gated delta net's weights (``kvserve.model.gated_delta``): in_proj (q, k, v, z, b, a, from four tensors or two),
    the depthwise kernel [channels, taps], dt's bias, A's log, the gated norm's weight [value_dim], out_proj."""
    h, heads = cfg.hidden_size, cfg.delta_value_heads
    keys, values = cfg.delta_key_heads * cfg.delta_key_dim, heads * cfg.delta_value_dim
    parts = [("delta_qkvz", 2 * keys + 2 * values), ("delta_ba", 2 * heads)] if arch.weight_name("delta_qkvz") else \
        [("delta_qkv", 2 * keys + values), ("delta_z", values), ("delta_b", heads), ("delta_a", heads)]
    linear(dst + "in_proj", prefix, parts, None, h, False)
    linear(dst + "out_proj", prefix, [("delta_out_proj", h)], None, values, False)
    out[f"{dst}kernel"] = [(f"{prefix}{arch.weight_name('delta_conv')}.weight", (2 * keys + values,
                                                                              cfg.delta_conv_kernel))]
    for ours, role, rows in (("dt_bias", "delta_dt_bias", heads), ("A_log", "delta_A_log", heads),
                             ("norm_weight", "delta_norm", cfg.delta_value_dim)):
        out[dst + ours] = [(f"{prefix}{arch.weight_name(role)}", (rows,))]


def latent_attention(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, prefix: str,
                     linear: Any) -> None:
    """Latent attention's weights (``kvserve.model.latent_attention``): q's latent (or q itself) and k/v's latent with
    the rotary key stacked into one GEMM on the layer's input (``qkv``), the latents' norms, their expansions (``q_b``,
    ``kv_b``) and ``o_proj``."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q_part = ("q_a_proj", cfg.q_lora_rank) if cfg.q_lora_rank else ("q_proj", heads * qk)
    linear(dst + "qkv", prefix, [q_part, ("kv_a_proj", cfg.kv_lora_rank + cfg.qk_rope_head_dim)], None, h,
           cfg.attention_bias)
    if cfg.q_lora_rank:
        out[f"{dst}q_norm.weight"] = [(f"{prefix}{arch.weight_name('q_a_norm')}.weight", (cfg.q_lora_rank,))]
        linear(dst + "q_b", prefix, [("q_b_proj", heads * qk)], None, cfg.q_lora_rank, False)
    out[f"{dst}kv_norm.weight"] = [(f"{prefix}{arch.weight_name('kv_a_norm')}.weight", (cfg.kv_lora_rank,))]
    linear(dst + "kv_b", prefix, [("kv_b_proj", heads * (cfg.qk_nope_head_dim + cfg.v_head_dim))], None,
           cfg.kv_lora_rank, False)
    linear(dst + "o_proj", prefix, [("o_proj", h)], None, heads * cfg.v_head_dim, cfg.o_proj_bias)


def mlp(out: dict[str, list[Source]], arch: Architecture, dst: str, prefix: str, kind: str, inter: int, h: int, bias: bool,
        gated: bool = True) -> None:
    """A gated MLP's gate_up and down: the layer's own (``kind`` ""), an expert's or the shared expert's (not
    ``gated``: up alone in gate_up)."""
    if kind == "unstacked_":
        gate, up, down, fused = "", "", "down", "gate_up"
    elif kind == "expert_":
        gate, up, down = (str(arch.weight_name(r)) for r in ("expert_gate", "expert_up", "expert_down"))
        fused = None
    elif kind == "shared_":
        gate, up, down = (str(arch.weight_name(r)) for r in ("shared_gate_proj", "shared_up_proj", "shared_down_proj"))
        fused = arch.weight_name("shared_gate_up_proj")
    else:
        gate, up, down = (str(arch.weight_name(r)) for r in ("gate_proj", "up_proj", "down_proj"))
        fused = arch.weight_name("gate_up_proj")
    suffixes = ("weight", "bias") if bias else ("weight",)
    for suffix in suffixes:
        rows = (lambda r: (r, h)) if suffix == "weight" else (lambda r: (r,))
        names = [(fused, (2 if gated else 1) * inter)] if fused else [(gate, inter), (up, inter)] if gated \
            else [(up, inter)]
        out[f"{dst}gate_up.{suffix}"] = [(f"{prefix}{n}.{suffix}", rows(r)) for n, r in names]
        out[f"{dst}down.{suffix}"] = [(f"{prefix}{down}.{suffix}", (h, inter) if suffix == "weight" else (h,))]


def expected_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the engine reads, with its shape (experts stored stacked: the stacked tensors)."""
    out = {name: shape for sources in weight_sources(cfg).values() for name, shape in sources}
    stacked = get_architecture(cfg.architecture).stacked_experts
    if stacked is None:
        return out
    h, e, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if not cfg.is_moe(i):
            continue
        for name in [n for n in out if n.startswith(p + UNSTACKED_ROOT)]:
            del out[name]
        out[f"{p}{stacked.gate_up}"] = stacked.stored_shape(e, 2 * inter, h)
        out[f"{p}{stacked.down}"] = stacked.stored_shape(e, h, inter)
        if cfg.expert_bias:
            out[f"{p}{stacked.gate_up}_bias"] = (e, 2 * inter)
            out[f"{p}{stacked.down}_bias"] = (e, h)
    return out


UNSTACKED_ROOT = "experts.unstacked."
UNSTACKED = UNSTACKED_ROOT + "{e}."  # under "model.layers.{i}.": an expert's cut of stacked tensors


def deinterleave_rotary(cfg: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` with q's and k's rows (and biases) of every head reordered, where ``cfg.rope_interleaved``, so that
    the dims rotating together as pairs (2i, 2i+1) sit at i and i + rotary_dim / 2, as rotate-half rotates them.
    Scores are unchanged (q and k reordered alike; v and o untouched); as given otherwise."""
    if not cfg.rope_interleaved or cfg.kv_lora_rank:  # latent attention reorders its rotary dims as it runs
        return weights
    import torch

    arch = get_architecture(cfg.architecture)
    if arch.weight_name("qkv_proj") is not None:
        raise ValueError(f"{cfg.architecture}: interleaved rotary over a stacked qkv tensor is not supported")
    d, rd = int(cfg.head_dim or 0), cfg.rotary_dim
    per_head = [*range(0, rd, 2), *range(1, rd, 2), *range(rd, d)]
    out = dict(weights)
    for i in range(cfg.num_hidden_layers):
        for role, heads in (("q_proj", cfg.num_attention_heads), ("k_proj", cfg.num_key_value_heads)):
            order = torch.tensor([h * d + j for h in range(heads) for j in per_head])
            for suffix in ("weight", "bias"):
                name = f"model.layers.{i}.{arch.weight_name(role)}.{suffix}"
                if name in out:  # a GGUF file's weight kept quantized (``QuantWeight``) takes its rows so
                    out[name] = out[name].rows(order) if hasattr(out[name], "rows") else out[name][order]
    return out


def standard_layout(cfg: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's linears as the other architectures store them: GPT-2's Conv1D weights ([in, out]:
    ``Architecture.transposed_linears``) transposed, GPT-NeoX's fused q/k/v rows (head by head, q, k and v of each:
    ``Architecture.qkv_per_head``) reordered to q's, then k's, then v's (biases too); gated attention's q_proj (each
    head's q then its gate) as every head's q, then every gate; Qwen3-Next's grouped delta-net projections
    (``ungroup_delta``); first what the architecture's own ``adjust_weights`` does (Falcon-H1's multipliers folded
    in); as given otherwise."""
    arch = get_architecture(cfg.architecture)
    if arch.adjust_weights is not None:
        weights = arch.adjust_weights(cfg, dict(weights))
    if not (arch.transposed_linears or arch.qkv_per_head or cfg.attn_output_gate or arch.weight_name("delta_qkvz")):
        return weights
    out = dict(weights)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if cfg.attn_output_gate and not cfg.is_recurrent(i):  # q_proj: each head's q, then its gate: q's first
            for suffix in ("weight", "bias"):
                if (name := f"{p}{arch.weight_name('q_proj')}.{suffix}") in out:
                    w = out[name]
                    out[name] = w.reshape(cfg.num_attention_heads, 2, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)
        if cfg.is_delta(i) and arch.weight_name("delta_qkvz"):
            out.update(ungroup_delta(cfg, out, p + str(arch.weight_name("delta_qkvz")) + ".weight",
                                     p + str(arch.weight_name("delta_ba")) + ".weight"))
    if arch.transposed_linears:
        for names in linear_sources(cfg).values():
            for name in names:
                if name in out and out[name].dim() == 2:
                    out[name] = out[name].t()
    if arch.qkv_per_head:
        heads, d = cfg.num_attention_heads, int(cfg.head_dim or 0)
        for i in range(cfg.num_hidden_layers):
            for suffix in ("weight", "bias"):
                name = f"model.layers.{i}.{arch.weight_name('qkv_proj')}.{suffix}"
                if name in out:
                    w = out[name]
                    out[name] = w.reshape(heads, 3, d, *w.shape[1:]).transpose(0, 1).reshape(w.shape)
    return out


def ungroup_delta(cfg: ModelConfig, weights: dict[str, Any], qkvz: str, ba: str) -> dict[str, Any]:
    """Qwen3-Next's stacked projections of a gated delta net, whose rows come a key head's group at a time (its q, k,
    v and z; its b and a), as q, k, v, z and b, a each whole (the order ``GatedDeltaNet.in_proj`` splits)."""
    groups, share = cfg.delta_key_heads, cfg.delta_value_heads // cfg.delta_key_heads
    kd, vd = cfg.delta_key_dim, share * cfg.delta_value_dim
    out = {}
    if qkvz in weights:
        w = weights[qkvz].reshape(groups, 2 * kd + 2 * vd, -1)
        out[qkvz] = stack_rows([part.reshape(-1, w.shape[-1]) for part in w.split([kd, kd, vd, vd], dim=1)])
    if ba in weights:
        w = weights[ba].reshape(groups, 2 * share, -1)
        out[ba] = stack_rows([part.reshape(-1, w.shape[-1]) for part in w.split([share, share], dim=1)])
    return out


def stack_rows(parts: list[Any]) -> Any:
    """The tensors' rows one after another (their own methods: this module imports no torch)."""
    out = parts[0].new_empty(sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    first = 0
    for part in parts:
        out[first : first + part.shape[0]] = part
        first += part.shape[0]
    return out


def unstack_experts(cfg: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` with each layer's stacked expert tensors (``StackedExperts``) cut into every expert's
    linear weights and biases (views: transposed, gate's and up's rows apart; a ``QuantExperts``' own
    QuantWeights), under the names ``weight_sources`` gives them; as given for an architecture that stores
    experts one by one."""
    stacked = get_architecture(cfg.architecture).stacked_experts
    if stacked is None:
        return weights
    out = dict(weights)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if not cfg.is_moe(i) or f"{p}{stacked.gate_up}" not in out:
            continue
        gate_up, down = out.pop(f"{p}{stacked.gate_up}"), out.pop(f"{p}{stacked.down}")
        gate_up_bias, down_bias = out.pop(f"{p}{stacked.gate_up}_bias", None), out.pop(f"{p}{stacked.down}_bias", None)
        for e in range(cfg.num_experts):
            name = p + UNSTACKED.format(e=e)
            gu_bias = None if gate_up_bias is None else gate_up_bias[e]
            if hasattr(gate_up, "experts"):  # kept quantized (``QuantExperts``): each expert's, gate's rows first
                gu = gate_up.experts[e]
            else:
                gu = stacked.orient(gate_up[e])
                if stacked.interleaved:  # gate's rows first, then up's, as the fused GEMM stacks them
                    gu = gu.reshape(-1, 2, gu.shape[1]).transpose(0, 1).reshape(gu.shape)
            if stacked.interleaved and gu_bias is not None:
                gu_bias = gu_bias.reshape(-1, 2).t().reshape(-1)
            out[f"{name}gate_up.weight"] = gu
            out[f"{name}down.weight"] = down.experts[e] if hasattr(down, "experts") else stacked.orient(down[e])
            if gu_bias is not None and down_bias is not None:
                out[f"{name}gate_up.bias"], out[f"{name}down.bias"] = gu_bias, down_bias[e]
    return out


def stack_experts(cfg: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    """The inverse of ``unstack_experts``, for a loader that reads each expert's gate, up and down apart (a GGUF
    file): they and their biases, under the architecture's per-expert names ("expert" + "expert_gate", ...),
    as the stacked tensors ``StackedExperts`` names, in its layout (dense), or as ``QuantExperts`` where
    gate, up and down are all quantized (the rest dequantized); as given for an architecture without them."""
    arch = get_architecture(cfg.architecture)
    stacked = arch.stacked_experts
    if stacked is None:
        return weights
    import torch

    from kvserve.model.quant import QuantExperts, QuantWeight

    out, roles = dict(weights), ("expert_gate", "expert_up", "expert_down")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."

        def name(e: int, role: str, suffix: str) -> str:
            return f"{p}{str(arch.weight_name('expert')).format(e=e)}{arch.weight_name(role)}.{suffix}"

        if not cfg.is_moe(i) or name(0, "expert_gate", "weight") not in out:
            continue
        parts = {(role, suffix): [out.pop(name(e, role, suffix)) for e in range(cfg.num_experts)]
                 for role in roles for suffix in ("weight", "bias") if name(0, role, suffix) in out}
        gate, up, down = (parts[(role, "weight")] for role in roles)
        if all(isinstance(w, QuantWeight) for w in gate + up + down):
            out[p + stacked.gate_up] = QuantExperts([QuantWeight.cat([g, u]) for g, u in zip(gate, up)], stacked.transposed)
            out[p + stacked.down] = QuantExperts(down, stacked.transposed)
        else:
            gate, up, down = ([w.dequantize() if isinstance(w, QuantWeight) else w for w in ws] for ws in (gate, up, down))
            out[p + stacked.gate_up] = torch.stack([stacked.orient(_pair(g, u, stacked.interleaved)) for g, u in zip(gate, up)])
            out[p + stacked.down] = torch.stack([stacked.orient(d) for d in down])
        if ("expert_gate", "bias") in parts:
            biases = zip(parts[("expert_gate", "bias")], parts[("expert_up", "bias")])
            out[f"{p}{stacked.gate_up}_bias"] = torch.stack([_pair(g, u, stacked.interleaved) for g, u in biases])
            out[f"{p}{stacked.down}_bias"] = torch.stack(parts[("expert_down", "bias")])
    return out


def stack_shared_gate_up(cfg: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    """The shared expert's gate and up weights, read apart (a GGUF file), as the one tensor (gate's rows, then up's)
    where the architecture's checkpoints stack them (``shared_gate_up_proj``); as given otherwise."""
    arch = get_architecture(cfg.architecture)
    fused = arch.weight_name("shared_gate_up_proj")
    if fused is None or not cfg.shared_expert_intermediate_size:
        return weights
    import torch

    from kvserve.model.quant import QuantWeight

    out = dict(weights)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.{arch.weight_name('shared_expert')}"
        gate, up = (f"{p}{arch.weight_name(role)}.weight" for role in ("shared_gate_proj", "shared_up_proj"))
        if gate not in out or up not in out:
            continue
        parts = [out.pop(gate), out.pop(up)]
        if all(isinstance(w, QuantWeight) for w in parts):
            out[f"{p}{fused}.weight"] = QuantWeight.cat(parts)
        else:
            out[f"{p}{fused}.weight"] = torch.cat([w.dequantize() if isinstance(w, QuantWeight) else w for w in parts])
    return out


def join_latent_kv(cfg: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    """kv_b_proj [heads * (nope + v), kv_lora_rank] from the two tensors llama.cpp's converter splits it into (for its
    absorbed attention): k_b [heads, kv_lora_rank, nope] (each head's k part transposed) and v_b [heads, v,
    kv_lora_rank], dense; as given where there are none."""
    if not cfg.kv_lora_rank:
        return weights
    import torch

    arch = get_architecture(cfg.architecture)
    out = dict(weights)
    for i in range(cfg.num_hidden_layers):
        k_name, v_name = (f"model.layers.{i}.{arch.weight_name(role)}.weight" for role in ("k_b_proj", "v_b_proj"))
        if k_name not in out or v_name not in out:
            continue
        k_b, v_b = (w.dequantize() if hasattr(w, "dequantize") else w for w in (out.pop(k_name), out.pop(v_name)))
        kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
        out[f"model.layers.{i}.{arch.weight_name('kv_b_proj')}.weight"] = kv_b.reshape(-1, cfg.kv_lora_rank)
    return out


def _pair(gate: Any, up: Any, interleaved: bool) -> Any:
    """An expert's gate and up rows (or biases) as the stacked tensor holds them: alternating or gate's first."""
    import torch

    return torch.stack([gate, up], dim=1).reshape(-1, *gate.shape[1:]) if interleaved else torch.cat([gate, up])


def linear_sources(cfg: ModelConfig, sources: dict[str, list[Source]] | None = None) -> dict[str, list[str]]:
    """The decoder's linear modules (by path) -> the checkpoint weights whose rows they stack
    (``sources``: ``weight_sources(cfg)`` where the caller has it already)."""
    table = weight_sources(cfg) if sources is None else sources
    return {path.removesuffix(".weight"): [n for n, _ in names] for path, names in table.items()
            if path.endswith(".weight") and path.removesuffix(".weight").rpartition(".")[2] in LINEARS}
