"""A step's decoder layers in one native call, where the model and the step allow it.

The native ``DecodeStack`` (kvserve/kernels/csrc/model/decode_stack.h; ``ops.decode_stack``) holds every layer's
weights and runs the same kernels the Python layers call (norms, quantized linears, rotary, paged
attention, the gated MLP's activation) back to back, so a decode step pays Python's per-op cost once, not
~12 times per layer. Each layer carries its spec, the options ``native_stack_blocker`` lets
through: norms before, after (OLMo 2) or around (Gemma) each sublayer, q/k norms per head or over the
projection, a sliding window, soft cap or sinks, biases, rotary by the model's tables, the local layers' (Gemma 3)
or none (SmolLM3), a mixture of experts (the ``MoEBlock`` its ``MoE`` runs: kvserve.model.moe_native), and for the model an activation (SiLU, GELU-tanh), a residual scale (Granite) and a
softmax scale; the embeddings' and logits' scales stay in Python. It runs in float32 models whose
linear layers are all quantized (``QuantLinear`` on the
native kernels: the default for the embedded GGUF model) and steps whose every row the paged
kernel attends (``AttentionBackend.native_step``), over a float32 or an 8-bit KV cache (which it
writes as the pool quantizes); anything else runs the Python layers. On an AMX CPU, a step of
``AMX_MIN_ROWS`` rows or more runs its linears in bf16 between OpenMP regions of the other ops: up to
``amx_linear_max_rows()`` rows (a decode step of up to 96 sequences) on the tile kernel (kernels/csrc/gemm/amx_gemm.cpp),
more in oneDNN's GEMM, as ``QuantLinear`` does with the same weights.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from kvserve.kernels import ops
from kvserve.model.config import NATIVE_ACTIVATIONS, ModelConfig
from kvserve.model.layers import padded_rows
from kvserve.model.mlp import MoE
from kvserve.model.moe_native import moe_blocker
from kvserve.model.quant_linear import AMX_MIN_ROWS, QuantLinear

if TYPE_CHECKING:
    from kvserve.attention import AttentionBackend, AttentionMetadata
    from kvserve.model.decoder import CausalLM, DecoderLayer

log = logging.getLogger(__name__)



def native_stack_blocker(cfg: ModelConfig) -> str | None:
    """None when the native decode stack runs every layer's options: Llama's layers with per-head or
    whole-projection q/k norms, any norm layout (pre, sandwich, post) and offset, a SiLU or GELU-tanh
    gated MLP, biases, a softmax scale, a window, a soft cap and sinks, residual scales, layers without rotary
    or with their own (Gemma 3's local base), mixtures of experts (with router and expert biases, a shared
    expert, gpt-oss's clamped SwiGLU in the experts); else the options it lacks, for the start-up log. (An MoE
    model's experts must also be packed quantized: ``build_native_stack`` checks the weights.)"""
    dense_swiglu = cfg.swiglu is not None and not all(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    checks = [(cfg.norm_type == "layer", "LayerNorms"), (cfg.norm_type == "l2", "L2 norms"),
              (not cfg.gated_mlp, "a non-gated MLP"),
              (cfg.norm_layout.startswith("parallel"), "a parallel residual"),
              (cfg.norm_layout == "post_add", "norms after the residual adds"), (not cfg.final_norm, "no final norm"),
              (cfg.hidden_act not in NATIVE_ACTIVATIONS, cfg.hidden_act),
              (cfg.partial_rotary_factor != 1, "partial rotary"),
              (cfg.clip_qkv is not None, "q/k/v clamps"),
              (cfg.qk_norm_after_rope, "q/k norms after rotary"),
              (cfg.qk_norm_type == "layer", "q/k LayerNorms"),
              (cfg.qk_norm_type == "unweighted", "q/k norms without weights"),
              (cfg.query_position_scale is not None, "queries scaled by position"),
              (bool(cfg.kv_lora_rank), "latent attention"), (bool(cfg.attention_experts), "routed query experts"),
              (bool(cfg.index_topk), "top-k key selection"), (cfg.moe_out_bias, "a bias on the experts' sum"),
              (cfg.conv_layers is not None and any(cfg.conv_layers), "short convolutions"),
              (cfg.mamba_layers is not None and any(cfg.mamba_layers), "Mamba layers"),
              (cfg.parallel_attention, "attention beside Mamba"),
              (cfg.alibi, "ALiBi"), (cfg.embed_norm, "a norm on the embeddings"),
              (cfg.attention_chunk is not None, "chunked attention"),
              (cfg.moe_scale_inputs, "experts scaling their inputs"),
              (cfg.delta_layers is not None and any(cfg.delta_layers),
               "lightning attention" if cfg.delta_rule == "lightning" else "gated delta nets"),
              (cfg.lru_layers is not None and any(cfg.lru_layers), "RG-LRU layers"),
              (cfg.rwkv_mix is not None, "RWKV mixes"),
              (cfg.mlstm is not None, "mLSTM layers"),
              (cfg.norm_layout == "normed_residual", "residuals taken after the norms"),
              (any(cfg.expert_clip_layers or ()) or any(cfg.shared_expert_clip_layers or ()),
               "SwiGLU clipped after the activation"),
              (cfg.attn_output_gate, "gated attention"),
              (cfg.residual_mix is not None, "residual mixes"),
              (cfg.expert_out_norm, "norms on the experts' outputs"), (bool(cfg.norm_gate_rank), "gated norms"),
              (cfg.stack_cycles is not None, "stacks run in cycles"),
              (cfg.recurrent_loops is not None, "looped layers"), (cfg.kv_nvfp4, "K/V rounded to NVFP4"),
              (cfg.query_channel_scale, "q scaled per channel"),
              (cfg.recurrent_norm_layout is not None, "norm layouts per layer"),
              (any(h != cfg.num_attention_heads for h in cfg.attention_heads_per_layer or ()),
               "query heads varying by layer"),
              (cfg.rope_local_partial_rotary_factor not in (None, cfg.partial_rotary_factor),
               "partial rotary on the sliding layers"),
              (cfg.router_scoring == "sparsemixer", "the sparsemixer router"),
              (cfg.attn_sub_norm, "a norm before o_proj"),
              (cfg.mlp_sub_norm, "a norm before the MLP's down projection"),
              (cfg.moe_out_norm, "a norm on the experts' output"),
              (cfg.selection_on_logits, "a selection bias on the router's logits"),
              (cfg.moe_shortcut, "experts added a layer later"), (bool(cfg.identity_experts), "identity experts"),
              (dense_swiglu, "a clamped SwiGLU"),
              (cfg.layer_head_dims is not None or cfg.layer_kv_heads is not None, "attention shapes per layer"),
              (cfg.v_norm or bool(cfg.k_eq_v_layers) or cfg.kv_shared_from is not None,
               "normed values, values from keys or K/V shared between layers"),
              (cfg.moe_beside_mlp or bool(cfg.per_layer_input_size) or cfg.layer_scalars,
               "experts beside the MLP, per-layer inputs or layer scalars"),
              (cfg.altup_streams > 1, "AltUp streams"), (bool(cfg.laurel_rank), "LAuReL"),
              (any(cfg.activation_sparsity or ()), "activation sparsity"),
              (cfg.shared_block_layers is not None and any(cfg.shared_block_layers), "shared transformer blocks"),
              (cfg.diff_attention, "differential attention"), (cfg.key_bias, "key biases"),
              (cfg.residual_weights, "weighted residuals"),
              (not cfg.first_input_norm, "no norm before the first layer"),
              (cfg.head_transform is not None, "a transform before the LM head"),
              (bool(cfg.v_head_dim) and not cfg.kv_lora_rank and cfg.v_head_dim != cfg.head_dim,
               "values narrower than keys")]
    return ", ".join(why for bad, why in checks if bad) or None

def build_native_stack(model: "CausalLM") -> Any | None:
    """A DecodeStack over ``model``'s layers, or None when some layer cannot run natively (the model's
    options are ``native_stack_blocker``'s to check; here, how its weights are held)."""
    cfg = model.config
    if not model.native or model.norm.weight.dtype != torch.float32:
        return None
    for layer in model.layers:
        mlp = layer.mlp
        if isinstance(mlp, MoE):  # the experts in the native block MoE.forward runs (moe_native)
            if mlp.native_block is None:
                log.info("%s: decode steps run the Python layers (an MoE layer's experts cannot run natively: %s)",
                         cfg.architecture, moe_blocker(mlp))
                return None
            linears: tuple[Any, ...] = (layer.self_attn.qkv, layer.self_attn.o_proj)
        else:
            linears = (layer.self_attn.qkv, layer.self_attn.o_proj, mlp.gate_up, mlp.down)
        if not all(isinstance(m, QuantLinear) and m.packed is not None for m in linears):
            return None
    stack = ops.decode_stack(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                             cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps)
    stack.set_model_options(NATIVE_ACTIVATIONS[cfg.hidden_act], cfg.residual_scale)
    for i, layer in enumerate(model.layers):
        _add_layer(stack, i, layer, model.uses_local[i], model.rotates[i])
    return stack


def _add_layer(stack: Any, i: int, layer: "DecoderLayer", local: bool, rotates: bool) -> None:
    """Layer ``i``'s weights and its options (its spec): each option the layer has, set once here."""
    a, mlp = layer.self_attn, layer.mlp
    pre = layer.layout != "post"
    dense = None if isinstance(mlp, MoE) else mlp
    stack.add_layer(_weight(layer.input_layernorm) if pre else None,
                    _weight(layer.post_attention_layernorm) if pre else None,
                    a.qkv.packed, a.qkv.kind, a.qkv.bias, a.o_proj.packed, a.o_proj.kind,
                    *((dense.gate_up.packed, dense.gate_up.kind, dense.down.packed, dense.down.kind) if dense
                      else (None, "", None, "")))
    if dense is None:
        stack.set_moe(i, mlp.native_block)
    if layer.layout != "pre":  # norms on each sublayer's output: Gemma's sandwich, OLMo 2's post
        stack.set_out_norms(i, _weight(layer.attn_out_norm), _weight(layer.mlp_out_norm))
    if a.qk_norm is not None:  # per head or over the whole projection: the weights' size says which
        stack.set_qk_norm(i, _weight(a.q_norm), _weight(a.k_norm))
    if a.spec.masked:
        stack.set_attention(i, a.spec.window or 0, a.spec.softcap or 0.0)
    if a.sinks is not None:
        stack.set_sinks(i, a.sinks.detach())
    if not rotates or local:
        stack.set_rotary(i, "local" if local else "none")
    mlp_linears = (dense.gate_up, dense.down) if dense else ()
    if any(m.bias is not None for m in (a.o_proj, *mlp_linears)):
        stack.set_biases(i, a.o_proj.bias, *(m.bias for m in mlp_linears), *((None, None) if dense is None else ()))
    linears = (a.qkv, a.o_proj, *mlp_linears)
    pad = (None, None) if dense is None else ()  # an MoE layer's experts stay on the integer kernels
    if all(m.amx is not None for m in linears):
        stack.add_amx_weights(i, *[m.amx.packed for m in linears], *pad)
    if all(m.tiles is not None for m in linears):  # a decode step's rows: the tile kernel
        stack.add_tile_weights(i, *[m.tiles for m in linears], *pad)


def _weight(norm: torch.nn.Module) -> torch.Tensor:
    return norm.weight.detach()


def amx_rows(stack: Any, rows: int) -> int:
    """The rows a step's linears run over in bf16 (padded as PackedLinear pads them; the tile kernel
    takes the step's own rows of them), or 0: the integer kernels (fewer than AMX_MIN_ROWS rows, or
    no bf16 weights: not an AMX CPU)."""
    return padded_rows(rows) if rows >= AMX_MIN_ROWS and stack.has_amx_weights() else 0


def run_native_stack(stack: Any, h: torch.Tensor, positions: torch.Tensor, model: "CausalLM",
                     attn: "AttentionBackend", meta: "AttentionMetadata",
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Run every layer on ``h`` in place when this step allows it; False (nothing done) otherwise."""
    native = attn.native_step(meta)
    if native is None or h.dtype != torch.float32:
        return False
    moe = next((layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)), None)
    if moe is not None and moe.loop_takes(h.shape[0]):  # the Python layers' experts run on AMX: so do these
        return False
    scaled = [layer for layer in kv_caches if getattr(layer, "k_scale", None) is not None]  # an 8-bit cache
    local = model.local_rotary
    scale = native.scale if model.config.attn_scale is None else model.config.attn_scale
    stack.set_invariant(native.invariant)
    stack.forward(h, positions, model.rotary.cos, model.rotary.sin, None if local is None else local.cos,
                  None if local is None else local.sin, [k for k, _ in kv_caches],
                  [v for _, v in kv_caches], [layer.k_scale for layer in scaled], [layer.v_scale for layer in scaled],
                  native.slot_mapping, native.block_tables, native.seq_info,
                  native.block_size, scale, amx_rows(stack, h.shape[0]))
    return True
