"""The checkpoint tensors of a layer's parts beyond plain attention (``kvserve.model.weights`` assembles the table from
them): a gated MLP's, the other token mixers' (short convolutions, Mamba-1/2, gated delta nets, latent attention and its
indexer, routed query experts), the shared transformer blocks' and the AltUp streams' weights. Torch-free."""

from __future__ import annotations

from typing import Any

from kvserve.model.architectures import Architecture
from kvserve.model.config import ModelConfig

Source = tuple[str, tuple[int, ...]]  # a checkpoint tensor's name and shape


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
    """A gated delta net's weights (``kvserve.model.gated_delta``): in_proj (q, k, v, z, b, a: one tensor, two or four),
    the depthwise kernel [channels, taps], dt's bias, A's log, the gated norm's weight [value_dim], out_proj."""
    if cfg.delta_rule == "kimi":
        return kimi_delta(out, arch, cfg, dst, prefix, linear)
    if cfg.delta_rule == "lightning":  # MiniMax's (kvserve.model.lightning): q/k/v and the output gate, norm, out_proj
        h, width = cfg.hidden_size, cfg.num_attention_heads * int(cfg.head_dim or 0)
        linear(dst + "in_proj", prefix, [("delta_qkv", 3 * width), ("delta_z", width)], None, h, False)
        linear(dst + "out_proj", prefix, [("delta_out_proj", h)], None, width, False)
        out[dst + "norm.weight"] = [(f"{prefix}{arch.weight_name('delta_norm')}", (width,))]
        return None
    h, heads = cfg.hidden_size, cfg.delta_value_heads
    keys, values = cfg.delta_key_heads * cfg.delta_key_dim, heads * cfg.delta_value_dim
    apart = [("delta_z", values), ("delta_b", heads), ("delta_a", heads)]
    if arch.weight_name("delta_in_proj"):
        parts = [("delta_in_proj", 2 * keys + 2 * values + 2 * heads)]
    elif arch.weight_name("delta_qkvz"):
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


def rglru(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, prefix: str,
          linear: Any) -> None:
    """Griffin's recurrent block (``kvserve.model.rglru``): in_proj (x, then y), the depthwise kernel [width, taps] and
    its bias, the gates' block-diagonal weights [blocks, in, out] and biases, the recurrence's parameter, out_proj."""
    h, w, blocks = cfg.hidden_size, cfg.lru_width, cfg.lru_blocks
    linear(dst + "in_proj", prefix, [("lru_x", w), ("lru_y", w)], None, h, True)
    linear(dst + "out_proj", prefix, [("lru_out", h)], None, w, True)
    conv = arch.weight_name("lru_conv")
    out[f"{dst}kernel"] = [(f"{prefix}{conv}.weight", (w, cfg.lru_conv_kernel))]
    out[f"{dst}conv_bias"] = [(f"{prefix}{conv}.bias", (w,))]
    lru = arch.weight_name("lru")
    for ours, theirs, shape in (("input_gate", "input_gate_weight", (blocks, w // blocks, w // blocks)),
                                ("input_gate_bias", "input_gate_bias", (blocks, w // blocks)),
                                ("recurrent_gate", "recurrent_gate_weight", (blocks, w // blocks, w // blocks)),
                                ("recurrent_gate_bias", "recurrent_gate_bias", (blocks, w // blocks)),
                                ("recurrent_param", "recurrent_param", (w,))):
        out[dst + ours] = [(f"{prefix}{lru}.{theirs}", shape)]


def rwkv(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, prefix: str, layer: int) -> None:
    """An RWKV time or channel mix (``kvserve.model.rwkv``): the token shift's mixes [hidden] (stored [1, 1, hidden]),
    the key/value/receptance linears, out_proj (the time mix's output, the channel mix's value), the time
    mix's decay and first-token bonus."""
    h, time = cfg.hidden_size, cfg.rwkv_mix[layer] == "time"  # type: ignore[index]
    p = prefix + str(arch.weight_name("rwkv_time" if time else "rwkv_channel"))
    inner = cfg.rwkv_attention_size if time else cfg.intermediate_size
    parts = ("key", "value", "receptance") if time else ("key", "receptance")
    for name in parts:
        out[f"{dst}mix_{name}"] = [(f"{p}.time_mix_{name}", (h,))]
        rows = h if name == "receptance" and not time else inner
        out[f"{dst}{name}.weight"] = [(f"{p}.{name}.weight", (rows, h))]
    out[f"{dst}out_proj.weight"] = [(f"{p}.{'output' if time else 'value'}.weight", (h, inner))]
    if time:
        for name in ("time_decay", "time_first"):
            out[dst + name] = [(f"{p}.{name}", (inner,))]


def mlstm(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, prefix: str,
          linear: Any) -> None:
    """An mLSTM layer (``kvserve.model.mlstm``): in_proj (q, k, v, the output gate), the gates (input, forget; with
    biases), the per-head norm's weight [v], out_proj."""
    shape, h = cfg.mlstm, cfg.hidden_size
    assert shape is not None
    linear(dst + "in_proj", prefix, [("mlstm_q", shape.qk_dim), ("mlstm_k", shape.qk_dim), ("mlstm_v", shape.v_dim),
                                     ("mlstm_ogate", shape.v_dim)], None, h, False)
    linear(dst + "gates", prefix, [("mlstm_igate", shape.heads), ("mlstm_fgate", shape.heads)], None, h, True)
    out[f"{dst}norm_weight"] = [(f"{prefix}{arch.weight_name('mlstm_norm')}.weight", (shape.v_dim,))]
    linear(dst + "out_proj", prefix, [("mlstm_out", h)], None, shape.v_dim, False)


def kimi_delta(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, prefix: str,
               linear: Any) -> None:
    """Kimi delta attention's weights (``kvserve.model.kimi_delta``): in_proj (q, k, v, the forget and output gates'
    low-rank inputs, b), their expansions (f_b, g_b, kept dense), the q, k and v convolutions' kernels, dt's bias
    [width], A's log [heads], the gated norm's weight [head_dim], out_proj."""
    h, heads, dim, rank = cfg.hidden_size, cfg.delta_value_heads, cfg.delta_value_dim, cfg.delta_gate_rank
    width = heads * dim
    gates = rank or width  # (rank 0: f and the output gate at full width, no expansions)
    linear(dst + "in_proj", prefix, [("delta_q", width), ("delta_k", width), ("delta_v", width), ("delta_f_a", gates),
                                     ("delta_g_a", gates), ("delta_b", heads)], None, h, False)
    linear(dst + "out_proj", prefix, [("delta_out_proj", h)], None, width, False)
    for ours, role in (("f_b", "delta_f_b"), ("g_b", "delta_g_b")) if rank else ():
        out[f"{dst}{ours}.weight"] = [(f"{prefix}{arch.weight_name(role)}.weight", (width, rank))]
    out[f"{dst}kernel"] = [(f"{prefix}{arch.weight_name(role)}.weight", (width, cfg.delta_conv_kernel))
                           for role in ("delta_q_conv", "delta_k_conv", "delta_v_conv")]
    for ours, role, rows in (("dt_bias", "delta_dt_bias", width), ("A_log", "delta_A_log", heads),
                             ("norm_weight", "delta_norm", dim)):
        out[dst + ours] = [(f"{prefix}{arch.weight_name(role)}", (rows,))]


def latent_attention(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, prefix: str,
                     linear: Any, layer: int) -> None:
    """Latent attention's weights (``kvserve.model.latent_attention``): q's latent (or q itself) and k/v's latent with
    the rotary key stacked into one GEMM on the layer's input (``qkv``), the latents' norms (and the rotary key's), their
    expansions (``q_b``, ``kv_b``), the output's gate a head and ``o_proj``."""
    h, heads = cfg.hidden_size, cfg.attention_heads(layer)
    q_lora, kv_lora, nope, rope, v_dim = cfg.latent_dims(layer)
    qk = nope + rope
    q_part = ("q_a_proj", q_lora) if q_lora else ("q_proj", heads * qk)
    linear(dst + "qkv", prefix, [q_part, ("kv_a_proj", kv_lora + rope)], None, h, cfg.attention_bias)
    if q_lora:
        out[f"{dst}q_norm.weight"] = [(f"{prefix}{arch.weight_name('q_a_norm')}.weight", (q_lora,))]
        gate, cols = (v_dim, 2 * q_lora) if cfg.latent_q_gate else (0, q_lora)  # (A.X-K2's q_b: q then its gate)
        linear(dst + "q_b", prefix, [("q_b_proj", heads * (qk + gate))], None, cols, False)
    out[f"{dst}kv_norm.weight"] = [(f"{prefix}{arch.weight_name('kv_a_norm')}.weight", (kv_lora,))]
    if cfg.latent_rope_key_norm:
        out[f"{dst}rope_key_norm.weight"] = [(f"{prefix}{arch.weight_name('rope_key_norm')}.weight", (rope,))]
    linear(dst + "kv_b", prefix, [("kv_b_proj", heads * (nope + v_dim))], None, kv_lora, False)
    if cfg.attn_output_gate:
        linear(dst + "gate", prefix, [("attn_gate_proj", heads)], None, h, False)
    linear(dst + "o_proj", prefix, [("o_proj", h)], None, heads * v_dim, cfg.o_proj_bias)


def indexer(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, prefix: str) -> None:
    """A lightning indexer's weights (``latent_attention.LatentAttention``): its q (from q's latent), its k and the k's
    LayerNorm (weight and bias), the head weights; linears kept dense (not in ``LINEARS``: the choice of keys is
    sensitive to them)."""
    heads, dim, h = cfg.index_heads, cfg.index_head_dim, cfg.hidden_size
    for ours, role, shape in (("index_q", "index_q", (heads * dim, cfg.q_lora_rank)), ("index_k", "index_k", (dim, h)),
                              ("index_weights", "index_weights", (heads, h))):
        out[f"{dst}{ours}.weight"] = [(f"{prefix}{arch.weight_name(role)}.weight", shape)]
    for suffix in ("weight", "bias"):
        out[f"{dst}index_k_norm.{suffix}"] = [(f"{prefix}{arch.weight_name('index_k_norm')}.{suffix}", (dim,))]


def routed_attention(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, prefix: str) -> None:
    """Routed query attention's weights (``kvserve.model.routed_attention``): the router, the experts' stacked q and o
    projections [experts, out, in], the output's bias, the shared k/v projection (k's rows, then v's)."""
    h, e, width = cfg.hidden_size, cfg.attention_experts, cfg.num_key_value_heads * int(cfg.head_dim or 0)
    for ours, role, shape in (("router.weight", "attn_router", (e, h)), ("q_experts", "attn_q_experts", (e, width, h)),
                              ("o_experts", "attn_o_experts", (e, h, width)), ("o_bias", "attn_o_bias", (h,)),
                              ("kv_proj.weight", "attn_kv_proj", (2 * width, h))):
        out[dst + ours] = [(f"{prefix}{arch.weight_name(role)}", shape)]


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


def altup(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, p: str) -> None:
    """A layer's AltUp router and coefficients, and LAuReL's branch (``kvserve.model.altup``)."""
    h, n, rank = cfg.hidden_size, cfg.altup_streams, cfg.laurel_rank
    if n > 1:
        a = f"{p}{arch.weight_name('altup')}."
        for name, shape in (("router_norm.weight", (h,)), ("modality_router.weight", (n, h)),
                            ("prediction_coefs.weight", (n * n, n)), ("correction_coefs.weight", (n, n)),
                            ("correct_output_scale", (h,))):
            out[f"{dst}altup.{name}"] = [(a + name, shape)]
    if rank:
        r = f"{p}{arch.weight_name('laurel')}."
        for name, shape in (("linear_left.weight", (rank, h)), ("linear_right.weight", (h, rank)),
                            ("post_laurel_norm.weight", (h,))):
            out[f"{dst}laurel.{name}"] = [(r + name, shape)]
