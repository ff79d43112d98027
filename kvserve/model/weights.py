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
    norm_suffixes = ("weight", "bias") if cfg.norm_type == "layer" and cfg.norm_bias else ("weight",)
    if not cfg.norm_affine:
        norm_suffixes = ()
    if cfg.embed_norm:
        for suffix in norm_suffixes:
            out[f"embed_norm.{suffix}"] = [(f"model.embed_norm.{suffix}", (h,))]

    def linear(dst: str, prefix: str, parts: list[tuple[str, int]], fused: str | None, cols: int, bias: bool) -> None:
        """``dst``.weight (and .bias) from the stacked tensor ``fused`` when the checkpoint has one, else
        from the ``parts`` (role, rows)."""
        names = [(fused, sum(r for _, r in parts))] if fused else [(arch.weight_name(role), r) for role, r in parts]
        for suffix, shape in (("weight", lambda r: (r, cols)), ("bias", lambda r: (r,)))[: 2 if bias else 1]:
            out[f"{dst}.{suffix}"] = [(f"{prefix}{name}.{suffix}", shape(r)) for name, r in names]

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
        if cfg.has_shared_block(i):
            shared_block_use(out, arch, cfg, dst + "shared_use.", p, i)
        if not cfg.has_mlp(i):
            continue
        if not cfg.is_moe(i) or cfg.moe_beside_mlp:
            mlp(out, arch, dst + "mlp.", p, "", cfg.mlp_size(i), h, cfg.mlp_bias, cfg.gated_mlp)
            if cfg.mlp_sub_norm:
                out[f"{dst}mlp.sub_norm.weight"] = [(f"{p}{arch.weight_name('mlp_sub_norm')}.weight",
                                                     (cfg.mlp_size(i),))]
            if cfg.hidden_act == "xielu":  # the activation's own parameters
                for name, shape in (("alpha_p", (1,)), ("alpha_n", (1,)), ("beta", ()), ("eps", ())):
                    out[f"{dst}mlp.act.{name}"] = [(f"{p}{arch.weight_name('act_fn')}.{name}", shape)]
        if cfg.is_moe(i):
            experts(out, arch, cfg, dst + ("moe." if cfg.moe_beside_mlp else "mlp."), p)
        layer_extras(out, arch, cfg, dst, p, norm_suffixes)
    if cfg.shared_block_layers is not None:
        shared_blocks(out, arch, cfg, linear)
    if cfg.per_layer_input_size:
        width = cfg.num_hidden_layers * cfg.per_layer_input_size
        for ours, theirs, shape in (("per_layer_embed.weight", "embed_tokens_per_layer", (cfg.per_layer_vocab_size, width)),
                                    ("per_layer_model_proj.weight", "per_layer_model_projection", (width, h)),
                                    ("per_layer_proj_norm.weight", "per_layer_projection_norm",
                                     (cfg.per_layer_input_size,))):
            out[ours] = [(f"model.{theirs}.weight", shape)]
    for suffix in norm_suffixes:
        out[f"norm.{suffix}"] = [(f"model.norm.{suffix}", (h,))]
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = [("lm_head.weight", (cfg.vocab_size, h))]
        if cfg.lm_head_bias:
            out["lm_head.bias"] = [("lm_head.bias", (cfg.vocab_size,))]
    return out


def shared_block_prefix(arch: Architecture, cfg: ModelConfig, block: int) -> str:
    """Where the checkpoint keeps shared block ``block``'s weights: under the first layer that uses it."""
    first = next(i for i in range(cfg.num_hidden_layers) if cfg.has_shared_block(i) and cfg.shared_block_of(i) == block)
    return f"model.layers.{first}.{arch.weight_name('shared_block')}"


def shared_blocks(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, linear: Any) -> None:
    """The shared blocks' weights (``kvserve.model.shared_block.SharedBlock``): the norm over [stream, embeddings],
    attention over that width (o_proj back to the hidden size), the MLP's norm and the gated MLP."""
    h, d = cfg.hidden_size, int(cfg.head_dim or 0)
    q_rows, kv_rows = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    uses = sum(cfg.shared_block_layers or ())
    for b in range(min(cfg.shared_blocks, uses)):
        p, dst = shared_block_prefix(arch, cfg, b), f"shared_blocks.{b}."
        for role, width in (("input_layernorm", 2 * h), ("post_attention_layernorm", h)):
            out[f"{dst}{role}.weight"] = [(f"{p}{arch.weight_name(role)}.weight", (width,))]
        linear(dst + "attention.qkv", p, [("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)], None, 2 * h,
               cfg.attention_bias)
        linear(dst + "attention.o_proj", p, [("o_proj", h)], None, q_rows, cfg.o_proj_bias)
        mlp(out, arch, dst + "mlp.", p, "", cfg.intermediate_size, h, cfg.mlp_bias)


def shared_block_use(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, p: str,
                     layer: int) -> None:
    """A layer's use of a shared block (``SharedBlockUse``): its linear onto the mixer's input, and its adapters (kept
    in the block's weights, by the use's index)."""
    h, r, d = cfg.hidden_size, cfg.shared_block_adapter_rank, int(cfg.head_dim or 0)
    out[f"{dst}out_proj.weight"] = [(f"{p}{arch.weight_name('shared_block_proj')}.weight", (h, h))]
    if not r:
        return
    bp, use = shared_block_prefix(arch, cfg, cfg.shared_block_of(layer)), cfg.shared_block_use(layer)

    def adapter(role: str) -> str:
        return bp + str(arch.weight_name(role)).format(k=use)

    if cfg.shared_block_qkv_adapters:
        roles = ("shared_q_adapter", "shared_k_adapter", "shared_v_adapter")
        out[f"{dst}qkv_down.weight"] = [(f"{adapter(role)}.0.weight", (r, 2 * h)) for role in roles]
        for ours, role, heads in (("q_up", roles[0], cfg.num_attention_heads),
                                  ("k_up", roles[1], cfg.num_key_value_heads),
                                  ("v_up", roles[2], cfg.num_key_value_heads)):
            out[f"{dst}{ours}.weight"] = [(f"{adapter(role)}.1.weight", (heads * d, r))]
    out[f"{dst}gate_up_down.weight"] = [(f"{adapter('shared_gate_up_adapter')}.0.weight", (r, h))]
    out[f"{dst}gate_up_up.weight"] = [(f"{adapter('shared_gate_up_adapter')}.1.weight", (2 * cfg.intermediate_size, r))]


def experts(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, p: str) -> None:
    """A layer's experts (``kvserve.model.mlp.MoE`` at ``dst``): the router, each expert, the shared expert."""
    h = cfg.hidden_size
    out[f"{dst}router.weight"] = [(f"{p}{arch.weight_name('router')}.weight", (cfg.num_experts, h))]
    if cfg.router_bias:
        out[f"{dst}router.bias"] = [(f"{p}{arch.weight_name('router')}.bias", (cfg.num_experts,))]
    if cfg.selection_bias:
        out[f"{dst}selection_bias"] = [(f"{p}{arch.weight_name('selection_bias')}", (1, cfg.num_experts))]
    for e in range(cfg.num_experts):
        if arch.stacked_experts is not None:  # the names unstack_experts gives each expert's cut
            mlp(out, arch, f"{dst}experts.{e}.", f"{p}{UNSTACKED.format(e=e)}", "unstacked_",
                cfg.moe_intermediate_size, h, cfg.expert_bias, cfg.gated_mlp)
            continue
        mlp(out, arch, f"{dst}experts.{e}.", p + str(arch.weight_name("expert")).format(e=e), "expert_",
            cfg.moe_intermediate_size, h, cfg.expert_bias, cfg.gated_mlp)
    if cfg.shared_expert_intermediate_size:
        mlp(out, arch, dst + "shared.", p + str(arch.weight_name("shared_expert")), "shared_",
            cfg.shared_expert_intermediate_size, h, False, cfg.gated_mlp)
        if cfg.shared_expert_gated:
            out[f"{dst}shared_gate.weight"] = [(f"{p}{arch.weight_name('shared_expert_gate')}.weight", (1, h))]


def layer_extras(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, p: str,
                        norm_suffixes: tuple[str, ...]) -> None:
    """The norms around experts beside the dense MLP, the per-layer input's branch, the layer's scalar."""
    h = cfg.hidden_size
    norms = ["moe_mlp_out_norm", "moe_in_norm", "moe_out_norm"] if cfg.moe_beside_mlp else []
    if cfg.per_layer_input_size:
        norms.append("per_layer_norm")
        for ours, role, shape in (("per_layer_gate", "per_layer_gate", (cfg.per_layer_input_size, h)),
                                  ("per_layer_proj", "per_layer_proj", (h, cfg.per_layer_input_size))):
            out[f"{dst}{ours}.weight"] = [(f"{p}{arch.weight_name(role)}.weight", shape)]
    for role in norms:
        for suffix in norm_suffixes:
            out[f"{dst}{role}.{suffix}"] = [(f"{p}{arch.weight_name(role)}.{suffix}", (h,))]
    if cfg.layer_scalars:
        out[f"{dst}layer_scalar"] = [(f"{p}{arch.weight_name('layer_scalar')}", (1,))]


def attention(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, prefix: str,
              linear: Any, layer: int) -> None:
    """Attention's weights (``kvserve.model.attention``): q/k/v in one GEMM, o_proj, the q/k norms (per head or over
    the whole projection; LayerNorms: ``head_norms``) and the sinks."""
    h, d = cfg.hidden_size, cfg.attn_head_dim(layer)
    q_rows, kv_rows = cfg.attention_heads(layer) * d, cfg.attn_kv_heads(layer) * d
    gated = 2 if cfg.attn_output_gate else 1  # q_proj's rows: q's, then the output gate's (standard_layout)
    q_parts = [("q_proj", gated * q_rows)]
    if cfg.attn_output_gate and arch.weight_name("attn_gate_proj"):  # the gate a tensor of its own: behind q's rows
        q_parts = [("q_proj", q_rows), ("attn_gate_proj", q_rows // d if cfg.attn_output_gate_per_head else q_rows)]
    # (a layer attending over another's K/V projects q alone; one whose values are its keys, no v)
    shares, k_is_v = cfg.shares_kv(layer), bool(cfg.k_eq_v_layers and cfg.k_eq_v_layers[layer])
    v_rows = cfg.attn_kv_heads(layer) * cfg.value_dim(layer)
    kv_parts = [] if shares else [("k_proj", kv_rows)] if k_is_v else [("k_proj", kv_rows), ("v_proj", v_rows)]
    linear(dst + "qkv", prefix, [*q_parts, *kv_parts], arch.weight_name("qkv_proj"), h, cfg.attention_bias)
    linear(dst + "o_proj", prefix, [("o_proj", h)], None, cfg.attention_heads(layer) * cfg.value_dim(layer),
           cfg.o_proj_bias)
    if not cfg.has_qk_norm(layer) or cfg.qk_norm_type == "unweighted":
        pass
    elif cfg.qk_norm_type == "layer":
        head_norms(out, arch, cfg, dst, prefix, layer)
    else:
        full = cfg.qk_norm == "full"
        for role, rows in (("q_norm", q_rows), ("k_norm", kv_rows))[: 1 if shares else 2]:
            out[f"{dst}{role}.weight"] = [(f"{prefix}{arch.weight_name(role)}.weight", (rows if full else d,))]
    if cfg.has_sinks(layer):
        out[f"{dst}sinks"] = [(f"{prefix}{arch.weight_name('sinks')}", (cfg.attention_heads(layer),))]
    if cfg.attn_sub_norm:
        out[f"{dst}sub_norm.weight"] = [(f"{prefix}{arch.weight_name('attn_sub_norm')}.weight", (q_rows,))]


def head_norms(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, prefix: str,
               layer: int) -> None:
    """Per-head q/k LayerNorms (``layers.HeadLayerNorm``): a weight [heads, head_dim] in one tensor, or in one a head
    where the architecture's name has "{h}" (StableLM's), or one [head_dim] the heads share; a bias alike."""
    d = int(cfg.head_dim or 0)
    suffixes = ("weight", "bias") if cfg.qk_norm_bias else ("weight",)
    for role, heads in (("q_norm", cfg.attention_heads(layer)), ("k_norm", cfg.num_key_value_heads)):
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
    heads = max(1, cfg.mamba_heads)  # (Zamba's heads: x_proj and dt_proj block-diagonal, one block a head)
    linear(dst + "x_proj", prefix, [("mamba_x_proj", heads * (rank + 2 * n))], None, inner, False)
    linear(dst + "dt_proj", prefix, [("mamba_dt_proj", inner)], None, heads * rank, True)
    conv = arch.weight_name("mamba_conv")
    out[f"{dst}kernel"] = [(f"{prefix}{conv}.weight", (inner, cfg.mamba_conv_kernel))]
    if cfg.mamba_conv_bias:
        out[f"{dst}conv_bias"] = [(f"{prefix}{conv}.bias", (inner,))]
    out[dst + "A_log"] = [(f"{prefix}{arch.weight_name('mamba_A_log')}", (inner, n))]
    out[dst + "D"] = [(f"{prefix}{arch.weight_name('mamba_D')}", (inner,))]
    if cfg.mamba_bcdt_norm_weights:  # Jamba's norms of dt, B and C
        for j, (role, rows) in enumerate((("mamba_dt_norm", rank), ("mamba_b_norm", n), ("mamba_c_norm", n))):
            out[f"{dst}bcdt_weights.{j}"] = [(f"{prefix}{arch.weight_name(role)}.weight", (rows,))]


def gated_delta(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, prefix: str,
                linear: Any) -> None:
    """A gated delta net's weights (``kvserve.model.gated_delta``): in_proj (q, k, v, z, b, a, from four tensors or two),
    the depthwise kernel [channels, taps], dt's bias, A's log, the gated norm's weight [value_dim], out_proj."""
    h, heads = cfg.hidden_size, cfg.delta_value_heads
    keys, values = cfg.delta_key_heads * cfg.delta_key_dim, heads * cfg.delta_value_dim
    apart = [("delta_z", values), ("delta_b", heads), ("delta_a", heads)]
    if arch.weight_name("delta_qkvz"):
        parts = [("delta_qkvz", 2 * keys + 2 * values), ("delta_ba", 2 * heads)]
    elif arch.weight_name("delta_q"):  # q, k and v each their own tensor (OLMo Hybrid's)
        parts = [("delta_q", keys), ("delta_k", keys), ("delta_v", values), *apart]
    else:
        parts = [("delta_qkv", 2 * keys + values), *apart]
    linear(dst + "in_proj", prefix, parts, None, h, False)
    linear(dst + "out_proj", prefix, [("delta_out_proj", h)], None, values, False)
    taps = cfg.delta_conv_kernel
    if arch.weight_name("delta_q_conv"):  # the convolution's q, k and v channels apart too
        out[f"{dst}kernel"] = [(f"{prefix}{arch.weight_name(role)}.weight", (rows, taps)) for role, rows in
                               (("delta_q_conv", keys), ("delta_k_conv", keys), ("delta_v_conv", values))]
    else:
        out[f"{dst}kernel"] = [(f"{prefix}{arch.weight_name('delta_conv')}.weight", (2 * keys + values, taps))]
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
    arch = get_architecture(cfg.architecture)
    for i in range(cfg.num_hidden_layers):  # scales the architecture folds into the router and experts at load
        for role, shape in (("router_input_scale", (cfg.hidden_size,)), ("expert_output_scale", (cfg.num_experts,))):
            if cfg.is_moe(i) and (name := arch.weight_name(role)):
                out[f"model.layers.{i}.{name}"] = shape
    stacked = arch.stacked_experts
    if stacked is None:
        return out
    h, e, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if not cfg.is_moe(i):
            continue
        for name in [n for n in out if n.startswith(p + UNSTACKED_ROOT)]:
            del out[name]
        gate_up = inter if stacked.up else 2 * inter  # gate's alone where up's are apart
        for name in (stacked.gate_up, stacked.up) if stacked.up else (stacked.gate_up,):
            out[f"{p}{name}"] = stacked.stored_shape(e, gate_up, h)
            if cfg.expert_bias:
                out[f"{p}{name}_bias"] = (e, gate_up)
        out[f"{p}{stacked.down}"] = stacked.stored_shape(e, h, inter, down=True)
        if cfg.expert_bias:
            out[f"{p}{stacked.down}_bias"] = (e, h)
    return out


UNSTACKED_ROOT = "experts.unstacked."
UNSTACKED = UNSTACKED_ROOT + "{e}."  # under "model.layers.{i}.": an expert's cut of stacked tensors


def linear_sources(cfg: ModelConfig, sources: dict[str, list[Source]] | None = None) -> dict[str, list[str]]:
    """The decoder's linear modules (by path) -> the checkpoint weights whose rows they stack
    (``sources``: ``weight_sources(cfg)`` where the caller has it already)."""
    table = weight_sources(cfg) if sources is None else sources
    return {path.removesuffix(".weight"): [n for n, _ in names] for path, names in table.items()
            if path.endswith(".weight") and path.removesuffix(".weight").rpartition(".")[2] in LINEARS}
