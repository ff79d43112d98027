"""A short convolution as a layer's token mixer (LFM2): in_proj to B, C and x, a depthwise causal convolution of
``conv_kernel`` taps over B * x, gated by C, then out_proj.

A token's output needs the convolution's inputs at the kernel's previous positions. They are kept per token in the
KV pool, in the slots of the layer's pool layers (``ModelConfig.cache_layers``: K's and V's widths side by side),
written and read through the block table like K and V. So prefix-cache hits, chunked prefill, preemption, speculative
steps and offload tiers carry them as they carry attention's cache, with no per-sequence state. It costs hidden_size
values a token per such layer, of which only the last kernel - 1 are read; a recurrent state per sequence (vLLM's
mamba cache) would be constant in length but outlive no prefix.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.attention.kv_pool import KVPool, LayerKV
from kvserve.model.config import ModelConfig
from kvserve.model.rotary import RotaryStep


class ShortConv(nn.Module):
    plain = False  # the decoder's bf16 hand-offs are attention's
    sinks = None

    def __init__(self, cfg: ModelConfig, layer: int):  # (``layer``: the mixers' one signature)
        super().__init__()
        self.hidden_size, self.taps = cfg.hidden_size, cfg.conv_kernel
        self.in_proj = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.conv_bias)
        self.kernel = nn.Parameter(torch.zeros(cfg.hidden_size, cfg.conv_kernel))  # [channels, taps], oldest first
        self.bias = nn.Parameter(torch.zeros(cfg.hidden_size)) if cfg.conv_bias else None
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.conv_bias)

    def runs_bf16(self, *args) -> bool:
        return False

    def forward(self, x, rope: RotaryStep | None, attn: AttentionBackend, meta: AttentionMetadata,
                kv_cache: list[LayerKV], bf16: bool = False, rows: torch.Tensor | None = None,
                tokens: int | None = None):
        """As ``Attention.forward``: ``kv_cache`` is the layer's pool layers; ``rope`` unused."""
        t = x.shape[0] if tokens is None else tokens
        b, c, u = self.in_proj(x)[:t].split(self.hidden_size, dim=-1)
        pool = attn.pool
        store_inputs(pool, kv_cache, meta.slot_mapping[:t], b * u)
        slots, exists = tap_slots(meta, self.taps, pool.block_size, pool.null_slot)
        # every tap as the pool holds it, this token's too: a step reads the same values whatever its chunking
        window = gather_inputs(pool, kv_cache, slots[:t], x.dtype, self.hidden_size)
        window = window.masked_fill(~exists[:t, :, None], 0)
        conv = (window * self.kernel.t().to(x.dtype)).sum(1)
        if self.bias is not None:
            conv = conv + self.bias
        y = c * conv
        return self.out_proj(y if rows is None else y[rows])


def store_inputs(pool: KVPool, layers: list[LayerKV], slots: torch.Tensor, values: torch.Tensor) -> None:
    """``values`` [T, hidden] into ``slots`` of ``layers``, spread over their K's and V's widths (zero-padded)."""
    k_shape = layers[0][0].shape[1:]
    width = k_shape.numel()
    padded = values.new_zeros(values.shape[0], 2 * width * len(layers))
    padded[:, : values.shape[1]] = values
    parts = padded.view(values.shape[0], len(layers), 2, *k_shape)
    for j, layer in enumerate(layers):
        pool.store(layer, slots, parts[:, j, 0], parts[:, j, 1])


def gather_inputs(pool: KVPool, layers: list[LayerKV], slots: torch.Tensor, dtype: torch.dtype,
                  hidden: int) -> torch.Tensor:
    """The values ``store_inputs`` wrote at ``slots`` (any shape S): [*S, hidden]."""
    parts = []
    for layer in layers:
        k, v = pool.gather(layer, slots, dtype)
        parts += [k.flatten(slots.dim()), v.flatten(slots.dim())]
    return torch.cat(parts, -1)[..., :hidden]


def tap_slots(meta: AttentionMetadata, taps: int, block_size: int, null_slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the step's rows, the pool slots of its position and the taps - 1 before it (oldest first) [T, taps],
    and whether each position exists (>= 0). Computed once a step: the step's metadata keeps them for every layer."""
    memo = getattr(meta, "conv_taps", None)
    if memo is not None and memo[0] == taps:
        return memo[1], memo[2]
    device = meta.slot_mapping.device
    back = torch.arange(taps - 1, -1, -1, device=device)
    slots, exists = [], []
    for seq in meta.seqs:
        table = torch.tensor(seq.block_table, dtype=torch.int64, device=device)
        pos = torch.arange(seq.start, seq.end, device=device)[:, None] - back
        ok = pos >= 0
        p = pos.clamp(min=0)
        slots.append(torch.where(ok, table[p // block_size] * block_size + p % block_size, null_slot))
        exists.append(ok)
    out = (torch.cat(slots), torch.cat(exists))
    meta.conv_taps = (taps, *out)  # type: ignore[attr-defined]
    return out
