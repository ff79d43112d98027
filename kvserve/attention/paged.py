"""The paged attention backend: a native kernel reads each sequence's K/V in place through its block
table, so no step copies contexts out of the cache (``gather-sdpa`` does, and the copy is a quarter
of a large decode step).

New keys and values are written to their slots first; then one call of
``torch.ops.kvserve.paged_attention`` (kvserve/kernels/csrc/paged_attention.cpp) attends every
row that reads the cache: decodes, prefill chunks continuing a context, speculative verify rows.
A chunk that starts its sequence has no cached context: torch SDPA attends over its fresh k/v,
whose GEMMs beat the kernel's dot products on a whole prompt. A long chunk that continues a
cached context (over LONG_CHUNK tokens) gathers that context and goes to SDPA too: there the
GEMMs win again (256 tokens after 1,024 cached: 0.75x with the kernel), and the gather is
small beside the chunk's own work.

An 8-bit KV cache (int8, fp8) is read by the kernel as stored, with its scales; the chunks that go
to SDPA dequantize just the context they gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.attention.backend import (AttentionBackend, AttentionMetadata, NativeAttention, SeqRows,
                                      register_attention_backend)
from kvserve.attention.kv_pool import KVPool, LayerKV
from kvserve.errors import InvalidArgumentError

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
EIGHT_BIT_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)  # read with their scales
LONG_CHUNK = 128


def paged_unsupported(device: torch.device, model_dtype: torch.dtype, kv_dtype: torch.dtype) -> str | None:
    """Why the paged kernel cannot serve this setup, or None when it can (this may build the kernels)."""
    if device.type != "cpu":
        return f"the device is {device.type} and the paged kernel runs on CPU only"
    if kv_dtype != model_dtype and kv_dtype not in EIGHT_BIT_DTYPES:
        return f"the KV cache stores {kv_dtype}, not the model's {model_dtype}"
    if model_dtype not in SUPPORTED_DTYPES:
        return f"the kernel reads float32 or bfloat16, not {model_dtype}"
    from kvserve.kernels import load_kernels

    if not load_kernels():
        return "the native kernels are not available (see the line logged above)"
    return None


@dataclass
class PagedMetadata(AttentionMetadata):
    # the kernel's rows: every table one after another, and per sequence (first row, rows, context, table offset)
    block_tables: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int32))
    seq_info: torch.Tensor = field(default_factory=lambda: torch.empty(0, 4, dtype=torch.int32))
    fresh: list[tuple[int, int]] = field(default_factory=list)  # (first row, rows) of chunks starting a sequence
    # long chunks continuing a context: (first row, rows, the context's slots, causal mask [rows, context])
    gathered: list[tuple[int, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)


class PagedBackend(AttentionBackend):
    # whether chunks that start a sequence go to SDPA (True) or to the kernel with the rest
    fresh_prefill_sdpa = True

    def __init__(self, pool: KVPool, model_dtype: torch.dtype):
        super().__init__(pool, model_dtype)
        reason = paged_unsupported(pool.device, model_dtype, pool.dtype)
        if reason is not None:
            raise InvalidArgumentError(f"the paged attention backend cannot run here: {reason}; "
                                       f"use --attention-backend gather-sdpa (or auto)", param="attention_backend")
        self.scale = pool.layout.head_dim ** -0.5

    def build_metadata(self, seqs: Sequence[SeqRows], num_decodes: int) -> PagedMetadata:
        # Plain Python lists, one tensor each at the end: this runs every step.
        bs = self.pool.block_size
        slots: list[int] = []
        info: list[int] = []
        tables: list[int] = []  # concatenated, not padded: one long context costs the others nothing
        fresh: list[tuple[int, int]] = []
        gathered: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        row = 0
        for s in seqs:
            n, table = len(s.tokens), s.block_table
            if n == 1:
                p = s.start
                slots.append(table[p // bs] * bs + p % bs)
            else:
                slots.extend(_slot_range(table, bs, s.start, s.end))
            if s.start == 0 and n > 1 and self.fresh_prefill_sdpa:
                fresh.append((row, n))
            elif s.start > 0 and n > LONG_CHUNK:
                context = torch.tensor(_slot_range(table, bs, 0, s.end), device=self.device)
                mask = torch.arange(s.end, device=self.device) <= torch.arange(s.start, s.end, device=self.device)[:, None]
                gathered.append((row, n, context, mask))
            else:
                info += (row, n, s.end, len(tables))
                tables += table
            row += n
        return PagedMetadata(
            slot_mapping=torch.tensor(slots, device=self.device),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            seq_info=torch.tensor(info, dtype=torch.int32).view(-1, 4),
            fresh=fresh,
            gathered=gathered,
        )

    def native_step(self, meta: PagedMetadata) -> NativeAttention | None:  # type: ignore[override]
        if meta.fresh or meta.gathered or not meta.seq_info.shape[0]:
            return None  # some rows go to SDPA
        return NativeAttention(meta.slot_mapping, meta.block_tables, meta.seq_info, self.pool.block_size, self.scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer_kv: LayerKV, meta: PagedMetadata) -> torch.Tensor:  # type: ignore[override]
        k_cache, v_cache = layer_kv
        self.pool.store(layer_kv, meta.slot_mapping, k, v)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty_like(q)
        if meta.seq_info.shape[0]:  # an 8-bit cache is read as stored, with its scales
            scales = (layer_kv.k_scale, layer_kv.v_scale) if self.pool.quantized else (None, None)
            torch.ops.kvserve.paged_attention(out, q, k_cache, v_cache, meta.block_tables, meta.seq_info,
                                              self.pool.block_size, self.scale, *scales)
        gqa = q.shape[1] != k.shape[1]
        for first, n in meta.fresh:
            rows = slice(first, first + n)
            kf, vf = self.pool.as_stored(layer_kv, k[rows], v[rows])
            o = F.scaled_dot_product_attention(q[rows].transpose(0, 1).unsqueeze(0), kf.transpose(0, 1).unsqueeze(0),
                                               vf.transpose(0, 1).unsqueeze(0), is_causal=True, enable_gqa=gqa)
            out[rows] = o[0].transpose(0, 1)
        for first, n, context, mask in meta.gathered:
            rows = slice(first, first + n)
            kc, vc = self.pool.gather(layer_kv, context, q.dtype)
            o = F.scaled_dot_product_attention(q[rows].transpose(0, 1).unsqueeze(0), kc.transpose(0, 1).unsqueeze(0),
                                               vc.transpose(0, 1).unsqueeze(0), attn_mask=mask, enable_gqa=gqa)
            out[rows] = o[0].transpose(0, 1)
        return out


register_attention_backend("paged", PagedBackend)


def _slot_range(table: list[int], bs: int, lo: int, hi: int) -> list[int]:
    """The slots of positions [lo, hi), a block at a time."""
    out: list[int] = []
    for b in range(lo // bs, (hi - 1) // bs + 1):
        base = table[b] * bs
        out.extend(range(base + max(lo - b * bs, 0), base + min(hi - b * bs, bs)))
    return out
