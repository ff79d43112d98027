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
from kvserve.model.weight_parts import (Source, altup, gated_delta, indexer, latent_attention, mamba, mlp, mlstm,
                                        rglru, routed_attention, rwkv, shared_block_use, shared_blocks, short_conv)

# the decoder's linear modules (last part of their path; q_b and kv_b: latent attention's expansions; in_proj and
# out_proj: a short convolution's or a Mamba layer's; key, value and receptance: RWKV's)
LINEARS = ("qkv", "o_proj", "gate_up", "down", "q_b", "kv_b", "in_proj", "out_proj", "key", "value", "receptance")


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
    if cfg.stack_cycles is not None:
        out["cycles.low_init"] = [("model.z_L_init", (h,))]
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
                if cfg.gated_norm(i, role):  # its gate's low-rank MLP
                    r = cfg.norm_gate_rank
                    for part, shape in (("gate_in", (r, h)), ("gate_out", (h, r))):
                        out[f"{dst}{role}.{part}.weight"] = [(f"{p}{name}.{part}.weight", shape)]
        if not cfg.has_mixer(i):
            pass
        elif cfg.is_mamba(i) and cfg.parallel_attention:
            attention(out, arch, cfg, dst + "self_attn.attn.", p, linear, i)
            mamba(out, arch, cfg, dst + "self_attn.mamba.", p, linear)
        elif cfg.is_mamba(i):
            mamba(out, arch, cfg, dst + "self_attn.", p, linear)
        elif cfg.is_delta(i):
            gated_delta(out, arch, cfg, dst + "self_attn.", p, linear)
        elif cfg.is_lru(i):
            rglru(out, arch, cfg, dst + "self_attn.", p, linear)
        elif cfg.is_mlstm(i):
            mlstm(out, arch, cfg, dst + "self_attn.", p, linear)
        elif cfg.is_rwkv(i):
            rwkv(out, arch, cfg, dst + "self_attn.", p, i)
        elif cfg.is_conv(i):
            short_conv(out, arch, cfg, dst + "self_attn.", p, linear)
        elif cfg.kv_lora_rank:
            latent_attention(out, arch, cfg, dst + "self_attn.", p, linear, i)
            if cfg.runs_indexer(i):
                indexer(out, arch, cfg, dst + "self_attn.", p)
        elif cfg.attention_experts:
            routed_attention(out, arch, cfg, dst + "self_attn.", p)
        else:
            attention(out, arch, cfg, dst + "self_attn.", p, linear, i)
        if cfg.has_shared_block(i):
            shared_block_use(out, arch, cfg, dst + "shared_use.", p, i)
        if not cfg.has_mlp(i):
            continue
        if not cfg.is_moe(i) or cfg.moe_beside_mlp:
            mlp(out, arch, dst + "mlp.", p, "", cfg.mlp_size(i), h, cfg.mlp_bias, cfg.gated_mlp)
            if cfg.mlp_sub_norm and cfg.norm_affine:
                out[f"{dst}mlp.sub_norm.weight"] = [(f"{p}{arch.weight_name('mlp_sub_norm')}.weight",
                                                     (cfg.mlp_size(i),))]
            if cfg.hidden_act == "xielu":  # the activation's own parameters
                for name, shape in (("alpha_p", (1,)), ("alpha_n", (1,)), ("beta", ()), ("eps", ())):
                    out[f"{dst}mlp.act.{name}"] = [(f"{p}{arch.weight_name('act_fn')}.{name}", shape)]
            if cfg.has_shortcut_moe(i):
                experts(out, arch, cfg, dst + "shortcut.", p)
        if cfg.is_moe(i):
            experts(out, arch, cfg, dst + ("moe." if cfg.moe_beside_mlp else "mlp."), p)
        layer_extras(out, arch, cfg, dst, p, norm_suffixes)
        altup(out, arch, cfg, dst, p)
    if cfg.altup_streams > 1:  # the streams' projections from the embeddings and back
        for j in range(cfg.altup_streams - 1):
            for ours, theirs in (("expand", "altup_projections"), ("collapse", "altup_unembed_projections")):
                out[f"altup_streams.{ours}.{j}.weight"] = [(f"model.{theirs}.{j}.weight", (h, h))]
    if cfg.shared_block_layers is not None:
        shared_blocks(out, arch, cfg, linear)
    if cfg.per_layer_input_size:
        width = cfg.num_hidden_layers * cfg.per_layer_input_size
        for ours, theirs, shape in (("per_layer_embed.weight", "embed_tokens_per_layer", (cfg.per_layer_vocab_size, width)),
                                    ("per_layer_model_proj.weight", "per_layer_model_projection", (width, h)),
                                    ("per_layer_proj_norm.weight", "per_layer_projection_norm",
                                     (cfg.per_layer_input_size,))):
            out[ours] = [(f"model.{theirs}.weight", shape)]
    for suffix in norm_suffixes if cfg.final_norm else ():
        out[f"norm.{suffix}"] = [(f"model.norm.{suffix}", (h,))]
    if cfg.head_transform is not None:  # (model.prediction_head.NormedHead: the final norm's dense and LayerNorm)
        out["norm.dense.weight"] = [("model.head_transform.dense.weight", (h, h))]
        if cfg.head_transform_bias:
            out["norm.dense.bias"] = [("model.head_transform.dense.bias", (h,))]
        for suffix in norm_suffixes:
            out[f"norm.head_norm.{suffix}"] = [(f"model.head_transform.norm.{suffix}", (h,))]
    if not cfg.tie_word_embeddings:
        rows = cfg.output_vocab_size or cfg.vocab_size
        out["lm_head.weight"] = [("lm_head.weight", (rows, h))]
        if cfg.lm_head_bias:
            out["lm_head.bias"] = [("lm_head.bias", (rows,))]
    if arch.sublayers > 1:
        out = {ours: [(in_checkpoint_layer(name, arch.sublayers), shape) for name, shape in names]
               for ours, names in out.items()}
    return out


def in_checkpoint_layer(name: str, sublayers: int) -> str:
    """Our layer j's tensor ``name`` as a checkpoint with ``sublayers`` of ours a layer names it: in layer
    j // sublayers, "{s}" in its role's name the sub-layer j % sublayers (LongCat-Flash's "self_attn.1.")."""
    head, _, rest = name.partition("model.layers.")
    if not rest:
        return name
    j, _, rest = rest.partition(".")
    return f"{head}model.layers.{int(j) // sublayers}.{rest.replace('{s}', str(int(j) % sublayers))}"
def experts(out: dict[str, list[Source]], arch: Architecture, cfg: ModelConfig, dst: str, p: str) -> None:
    """An MoE block's weights (``mlp.MoE`` at ``dst``): the router (a row per expert, then per identity expert), the
    selection bias, the output norm, each expert's gated MLP, the shared expert and its gate."""
    h, routes = cfg.hidden_size, cfg.num_experts + cfg.identity_experts
    out[f"{dst}router.weight"] = [(f"{p}{arch.weight_name('router')}.weight", (routes, h))]
    if cfg.router_bias:
        out[f"{dst}router.bias"] = [(f"{p}{arch.weight_name('router')}.bias", (routes,))]
    if cfg.moe_out_bias:
        out[f"{dst}out_bias"] = [(f"{p}{arch.weight_name('moe_out_bias')}", (h,))]
    if cfg.selection_bias:
        out[f"{dst}selection_bias"] = [(f"{p}{arch.weight_name('selection_bias')}", (1, routes))]
    if cfg.expert_out_norm:
        out[f"{dst}expert_norms"] = [(f"{p}{arch.weight_name('expert_out_norms')}", (cfg.num_experts, h))]
        if cfg.shared_expert_intermediate_size:
            out[f"{dst}shared_norm.weight"] = [(f"{p}{arch.weight_name('shared_out_norm')}", (h,))]
    if cfg.moe_out_norm:
        out[f"{dst}out_norm.weight"] = [(f"{p}{arch.weight_name('moe_out_norm')}.weight", (h,))]
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
    norms = ["moe_mlp_out_norm", "moe_in_norm", "experts_out_norm"] if cfg.moe_beside_mlp else []
    if cfg.per_layer_input_size:
        norms.append("per_layer_norm")
        for ours, role, shape in (("per_layer_gate", "per_layer_gate", (cfg.per_layer_input_size, h)),
                                  ("per_layer_proj", "per_layer_proj", (h, cfg.per_layer_input_size))):
            out[f"{dst}{ours}.weight"] = [(f"{p}{arch.weight_name(role)}.weight", shape)]
    for role in norms:
        for suffix in norm_suffixes:
            out[f"{dst}{role}.{suffix}"] = [(f"{p}{arch.weight_name(role)}.{suffix}", (h,))]
    if cfg.residual_weights:
        for role in ("attn_residual", "mlp_residual"):
            out[f"{dst}{role}"] = [(f"{p}{arch.weight_name(role)}", (h,))]
    if cfg.residual_mix in ("gated", "interpolate"):
        out[f"{dst}residual_gates"] = [(f"{p}{arch.weight_name(role)}", (h,))
                                       for role in ("attn_residual_gate", "mlp_residual_gate")]
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
    if not cfg.has_qk_norm(layer) or cfg.qk_norm_type in ("unweighted", "l2"):
        pass
    elif cfg.qk_norm_type == "layer":
        head_norms(out, arch, cfg, dst, prefix, layer)
    else:
        full = cfg.qk_norm == "full"
        for role, rows in (("q_norm", q_rows), ("k_norm", kv_rows))[: 1 if shares else 2]:
            out[f"{dst}{role}.weight"] = [(f"{prefix}{arch.weight_name(role)}.weight", (rows if full else d,))]
    if cfg.attn_output_gate_bias:
        out[f"{dst}gate_bias"] = [(f"{prefix}{arch.weight_name('attn_gate_bias')}", (cfg.attention_heads(layer),))]
    if cfg.has_sinks(layer):
        out[f"{dst}sinks"] = [(f"{prefix}{arch.weight_name('sinks')}", (cfg.attention_heads(layer),))]
    if cfg.diff_attention:  # (lambda_q1, lambda_k1, lambda_q2, lambda_k2)
        out[f"{dst}diff.lambdas"] = [(f"{prefix}{arch.weight_name('diff_lambda')}{part}", (d,))
                                     for part in ("q1", "k1", "q2", "k2")]
    if cfg.key_bias:  # (dt_proj over the values, A a tensor)
        linear(dst + "dyn.dt_proj", prefix, [("dt_proj", cfg.attn_kv_heads(layer))], None, kv_rows, cfg.attention_bias)
        out[f"{dst}dyn.A"] = [(f"{prefix}{arch.weight_name('dt_A')}", (cfg.attn_kv_heads(layer),))]
    if cfg.query_channel_scale:
        out[f"{dst}q_scale"] = [(f"{prefix}{arch.weight_name('attn_q_scale')}", (q_rows,))]
    if cfg.attn_sub_norm and cfg.norm_affine:
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


def expected_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the engine reads, with its shape (experts stored stacked: the stacked tensors)."""
    out = {name: shape for sources in weight_sources(cfg).values() for name, shape in sources}
    arch = get_architecture(cfg.architecture)
    for i in range(cfg.num_hidden_layers):  # scales the architecture folds into the router and experts at load
        for role, shape in (("router_input_scale", (cfg.hidden_size,)), ("expert_output_scale", (cfg.num_experts,))):
            if cfg.is_moe(i) and (name := arch.weight_name(role)):
                out[f"model.layers.{i}.{name}"] = shape
    out.update(arch.folded_weights(cfg) if arch.folded_weights is not None else {})
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
        gate_up = inter if stacked.up or not cfg.gated_mlp else 2 * inter  # gate's alone where up's are apart
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
