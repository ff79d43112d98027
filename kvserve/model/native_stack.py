"""A step's decoder layers in one native call, where the model and the step allow it.

The native ``DecodeStack`` (kvserve/kernels/csrc/model/decode_stack.h; ``ops.decode_stack``) holds every layer's
weights and runs the same kernels the Python layers call (norms, quantized linears, rotary, paged
attention, SwiGLU) back to back, so a decode step pays Python's per-op cost once, not ~12 times
per layer. It covers Llama's layers and Qwen3's (``ModelConfig.llama_layers``), each with its sliding
window or soft cap if any (Mistral's window: the paged kernel takes both), in float32 models whose
linear layers are all quantized (``QuantLinear`` on the
native kernels: the default for the embedded GGUF model) and steps whose every row the paged
kernel attends (``AttentionBackend.native_step``), over a float32 or an 8-bit KV cache (which it
writes as the pool quantizes); anything else runs the Python layers. On an AMX CPU, a step of
``AMX_MIN_ROWS`` rows or more runs its linears in bf16 between OpenMP regions of the other ops: up to
``amx_linear_max_rows()`` rows (a decode step of up to 96 sequences) on the tile kernel (kernels/csrc/gemm/amx_gemm.cpp),
more in oneDNN's GEMM, as ``QuantLinear`` does with the same weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvserve.kernels import ops
from kvserve.model.layers import padded_rows
from kvserve.model.quant_linear import AMX_MIN_ROWS, QuantLinear

if TYPE_CHECKING:
    from kvserve.attention import AttentionBackend, AttentionMetadata
    from kvserve.model.decoder import CausalLM


def build_native_stack(model: "CausalLM") -> Any | None:
    """A DecodeStack over ``model``'s layers, or None when some layer cannot run natively."""
    cfg = model.config
    if not model.native or model.norm.weight.dtype != torch.float32:
        return None
    for layer in model.layers:
        linears = (layer.self_attn.qkv, layer.self_attn.o_proj, layer.mlp.gate_up, layer.mlp.down)
        if not all(isinstance(m, QuantLinear) and m.packed is not None for m in linears):
            return None
        if any(m.bias is not None for m in linears[1:]):
            return None
    stack = ops.decode_stack(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                             cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps)
    for layer in model.layers:
        a, mlp = layer.self_attn, layer.mlp
        stack.add_layer(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                        a.qkv.packed, a.qkv.kind, a.qkv.bias, a.o_proj.packed, a.o_proj.kind,
                        mlp.gate_up.packed, mlp.gate_up.kind, mlp.down.packed, mlp.down.kind)
        if a.qk_norm == "head":
            stack.set_qk_norm(stack.num_layers() - 1, a.q_norm.weight.detach(), a.k_norm.weight.detach())
        if a.spec.masked:
            stack.set_attention(stack.num_layers() - 1, a.spec.window or 0, a.spec.softcap or 0.0)
        linears = (a.qkv, a.o_proj, mlp.gate_up, mlp.down)
        if all(m.amx is not None for m in linears):
            stack.add_amx_weights(stack.num_layers() - 1, *[m.amx.packed for m in linears])
        if all(m.tiles is not None for m in linears):  # a decode step's rows: the tile kernel
            stack.add_tile_weights(stack.num_layers() - 1, *[m.tiles for m in linears])
    return stack


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
    scaled = [layer for layer in kv_caches if getattr(layer, "k_scale", None) is not None]  # an 8-bit cache
    stack.forward(h, positions, model.rotary.cos, model.rotary.sin, [k for k, _ in kv_caches],
                  [v for _, v in kv_caches], [layer.k_scale for layer in scaled], [layer.v_scale for layer in scaled],
                  native.slot_mapping, native.block_tables, native.seq_info,
                  native.block_size, native.scale, amx_rows(stack, h.shape[0]))
    return True
