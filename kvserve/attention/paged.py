"""The paged attention backend: a native kernel reads each sequence's K/V in place through its block
table, so no step copies contexts out of the cache (``gather-sdpa`` does, and the copy is a quarter
of a large decode step).

New keys and values are written to their slots first; then one call of
``ops.paged_attention`` (kvserve/kernels/csrc/attention/paged_attention.cpp) attends every
row that reads the cache: decodes, prefill chunks continuing a context, speculative verify rows.
A chunk that starts its sequence has no cached context: torch SDPA attends over its fresh k/v,
whose GEMMs beat the kernel's dot products on a whole prompt. A long chunk that continues a
cached context (over LONG_CHUNK tokens) gathers that context and goes to SDPA too: there the
GEMMs win again (256 tokens after 1,024 cached: 0.75x with the kernel), and the gather is
small beside the chunk's own work.

Where the runner sets ``prefill_dtype`` to bfloat16 (a quantized float32 model on an AMX CPU), the
chunks that go to SDPA attend in bf16, whose GEMMs run on AMX tiles with float32 accumulation:
2.5-3x torch's float32 flash attention. Then chunks over BF16_LONG_CHUNK tokens already go.

Where the kernels can (a bf16 cache and brgemm on AMX: ``flash_prefill``), those prompt chunks go to
``ops.flash_prefill`` instead of SDPA: it reads the cache through the tables as the
decode kernel does (no gather, no pieces to merge), runs both GEMMs on AMX tiles with the GQA heads
stacked as rows, and its softmax costs about half of torch's (the prefix-RAG wave 1.45-1.5 -> 1.2-1.28 s).

An 8-bit KV cache (int8, fp8) is read by the kernel as stored, with its scales; the chunks that go
to SDPA dequantize just the context they gather.

A layer with a sliding window or a soft cap on its scores (Mistral, Gemma 2/3, Phi-3) has every row
attended by the kernels, which take both (``attend_layer``): the SDPA pieces take neither, so its
prompt chunks go to ``flash_prefill`` where that runs, else to the paged kernel with the rest. A
windowed row reads only its window's blocks, so a long context costs the window. Sinks (gpt-oss) the paged
kernel takes too; a step with ``flash_prefill`` rows sends a layer with sinks to the general path.

With ``invariant`` (the default wherever it costs nothing: ``--deterministic``, docs/determinism.md) every row
goes to the paged kernel, none to SDPA or ``flash_prefill``: a token gets the same arithmetic decoded, verified
or in a prompt chunk of any length. On the CPUs measured the kernel is as fast as SDPA on whole prompts
(docs/benchmarks.md).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.attention.backend import (AttentionBackend, AttentionMetadata, NativeAttention, SeqRows,
                                      register_attention_backend)
from kvserve.attention.general import LayerAttention
from kvserve.attention.kv_pool import KVPool, LayerKV
from kvserve.errors import InvalidArgumentError
from kvserve.kernels import ops
from kvserve.kv.block_pool import NO_BLOCK

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
EIGHT_BIT_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)  # read with their scales
BF16_KV_F32_MODEL = (torch.bfloat16, torch.float32)  # the kernel widens bf16 K/V itself
LONG_CHUNK = 128
MIN_SHARED_PREFIX = 64  # cached tokens chunks must share before their group attends the prefix once
BF16_LONG_CHUNK = 16  # with bf16 SDPA (AMX) the GEMMs win from 32 rows after ~1.8k cached: 0.8x the kernel's time
# flash_prefill (AMX brgemm; kernels/csrc/attention/flash_prefill.cpp) attends chunks of this many rows or more that
# start a sequence or run past BF16_LONG_CHUNK, in place of SDPA; KVSERVE_FLASH_PREFILL=0 keeps SDPA.
FLASH_MIN_ROWS = 2
FLASH_PREFILL = os.environ.get("KVSERVE_FLASH_PREFILL", "1") != "0"


def paged_unsupported(device: torch.device, model_dtype: torch.dtype, kv_dtype: torch.dtype) -> str | None:
    """Why the paged kernel cannot serve this setup, or None when it can (this may build the kernels)."""
    if device.type != "cpu":
        return f"the device is {device.type} and the paged kernel runs on CPU only"
    if kv_dtype != model_dtype and kv_dtype not in EIGHT_BIT_DTYPES and (kv_dtype, model_dtype) != BF16_KV_F32_MODEL:
        return f"the KV cache stores {kv_dtype}, not the model's {model_dtype}"
    if model_dtype not in SUPPORTED_DTYPES:
        return f"the kernel reads float32 or bfloat16, not {model_dtype}"
    from kvserve.kernels import load_kernels

    if not load_kernels():
        return "the native kernels are not available (see the line logged above)"
    return None


@dataclass
class ContextChunk:
    """A long chunk continuing a cached context: SDPA over the context, in pieces merged by their
    log-sum-exps (the group's shared prefix, the rest of the cached context, the chunk's own tokens).
    Only the last piece needs a mask, and being square it is plain causal: nothing is computed for
    masked-out keys, and no mask tensor is built."""

    first: int  # its first row in the step
    rows: int
    cached_slots: torch.Tensor | None  # its cached context after the group's prefix (None: empty)


@dataclass
class ContextGroup:
    """Chunks whose contexts begin with the same cached blocks (a prefix the radix cache shares, as
    when several requests on one document arrive together): cascade attention. All their rows attend
    the shared prefix in one SDPA (no mask: it precedes every row), so the prefix is gathered once
    and its GEMMs get every member's rows. A group of one chunk has no shared prefix."""

    prefix: int  # shared tokens (0: none)
    prefix_slots: torch.Tensor | None
    chunks: list[ContextChunk]


@dataclass
class PagedMetadata(AttentionMetadata):
    # the kernel's rows: every table one after another, and per sequence (first row, rows, context, table offset)
    block_tables: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int32))
    seq_info: torch.Tensor = field(default_factory=lambda: torch.empty(0, 4, dtype=torch.int32))
    fresh: list[tuple[int, int]] = field(default_factory=list)  # (first row, rows) of chunks starting a sequence
    gathered: list[ContextGroup] = field(default_factory=list)  # long chunks continuing a context
    # chunks of more than one row that flash_prefill attends (where it runs), in seq_info's form
    flash_tables: torch.Tensor | None = None
    flash_info: torch.Tensor | None = None
    # every row flash_prefill does not take, in seq_info's form: what windowed or capped layers hand the
    # paged kernel (built by the first such layer of the step)
    all_rows: tuple[torch.Tensor, torch.Tensor] | None = None


class PagedBackend(AttentionBackend):
    # whether chunks that start a sequence go to SDPA (True) or to the kernel with the rest
    fresh_prefill_sdpa = True
    # Batch invariance (the runner sets it: ``--deterministic``): every row goes to the paged kernel, whose
    # result for a row depends only on its query and its context, however the step is made up: no SDPA
    # or flash_prefill pieces (a prompt token would otherwise get other arithmetic than the same token
    # decoded, verified or recomputed after a prefix hit), and no decode-only bf16 shortcuts.
    invariant = False

    def __init__(self, pool: KVPool, model_dtype: torch.dtype):
        super().__init__(pool, model_dtype)
        reason = paged_unsupported(pool.device, model_dtype, pool.dtype)
        if reason is not None:
            raise InvalidArgumentError(f"the paged attention backend cannot run here: {reason}; "
                                       f"use --attention-backend gather-sdpa (or auto)", param="attention_backend")
        self.scale = pool.layout.head_dim ** -0.5
        layout = pool.layout
        dims = {layout.shape(i)[1] for i in range(layout.num_layers)} or {layout.head_dim}
        self._flash_runs = (pool.dtype == torch.bfloat16 and not pool.quantized and not any(d % 32 for d in dims)
                            and max(dims) <= 256 and ops.flash_prefill_available())

    def flash_prefill(self) -> bool:
        """Whether prompt chunks go to ``flash_prefill`` (bf16 prefill over a bf16 cache, head_dim a
        multiple of 32, and a build and CPU whose brgemm runs bf16: AMX) rather than to torch's SDPA."""
        return self.prefill_dtype == torch.bfloat16 and self._flash_runs and FLASH_PREFILL

    def warm_up(self, num_heads: int) -> None:
        """flash_prefill's brgemm kernels, one per GEMM shape (query tokens per task x keys per block):
        otherwise the first prompts pay ~10 ms in the first layer that meets them."""
        if not self.flash_prefill():
            return
        layout, bs = self.pool.layout, self.pool.block_size
        # every task size (8-64 query tokens) with a full 256-key block, then a last block of each size
        seqs = [(rows, 256 + keys) for rows in range(8, 65, 8) for keys in range(32, 257, 32)]
        blocks = torch.arange(-(-512 // bs), dtype=torch.int32)
        info = torch.tensor([(sum(r for r, _ in seqs[:i]), r, c, 0) for i, (r, c) in enumerate(seqs)], dtype=torch.int32)
        k = torch.zeros(blocks.numel() * bs, layout.num_kv_heads, layout.head_dim, dtype=torch.bfloat16)
        q = torch.zeros(sum(r for r, _ in seqs), num_heads, layout.head_dim, dtype=torch.bfloat16)
        ops.flash_prefill(torch.empty_like(q), q, k, k, blocks, info, bs, self.scale)

    def build_metadata(self, seqs: Sequence[SeqRows], num_decodes: int) -> PagedMetadata:
        # Plain Python lists, one tensor each at the end: this runs every step.
        bs = self.pool.block_size
        slots: list[int] = []
        info: list[int] = []
        tables: list[int] = []  # concatenated, not padded: one long context costs the others nothing
        fresh: list[tuple[int, int]] = []
        long: list[tuple[int, SeqRows]] = []
        long_chunk = BF16_LONG_CHUNK if self.prefill_dtype == torch.bfloat16 else LONG_CHUNK
        flash = self.flash_prefill() and not self.invariant
        kernel_only = self.invariant
        flash_info: list[int] = []
        flash_tables: list[int] = []
        row = 0
        for s in seqs:
            n, table = len(s.tokens), s.block_table
            if n == 1:
                p = s.start
                slots.append(table[p // bs] * bs + p % bs)
            else:
                slots.extend(_slot_range(table, bs, s.start, s.end))
            if flash and n >= FLASH_MIN_ROWS and (s.start == 0 or n > long_chunk):
                flash_info += (row, n, s.end, len(flash_tables))
                flash_tables += table
            elif s.start == 0 and n > 1 and self.fresh_prefill_sdpa and not kernel_only:
                fresh.append((row, n))
            elif s.start > 0 and n > long_chunk and not kernel_only:
                long.append((row, s))
            else:
                info += (row, n, s.end, len(tables))
                tables += table
            row += n
        return PagedMetadata(
            slot_mapping=torch.tensor(slots, device=self.device),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            seq_info=torch.tensor(info, dtype=torch.int32).view(-1, 4),
            fresh=fresh,
            gathered=self._context_groups(long),
            flash_tables=torch.tensor(flash_tables, dtype=torch.int32) if flash_info else None,
            flash_info=torch.tensor(flash_info, dtype=torch.int32).view(-1, 4) if flash_info else None,
            seqs=seqs,
        )

    def _context_groups(self, long: list[tuple[int, SeqRows]]) -> list[ContextGroup]:
        """The long chunks, grouped by the cached blocks their tables begin with."""
        bs, dev = self.pool.block_size, self.device
        by_first: dict[int, list[tuple[int, SeqRows]]] = {}
        for row, s in long:
            # tables a sliding window emptied at the front (NO_BLOCK) share nothing there
            key = s.block_table[0] if s.block_table[0] != NO_BLOCK else -1 - row
            by_first.setdefault(key, []).append((row, s))
        groups = []
        for members in by_first.values():
            shared = 0  # blocks every member's table starts with, all before every member's chunk
            if len(members) > 1:
                first_table = members[0][1].block_table
                limit = min(s.start for _, s in members) // bs
                while shared < limit and all(s.block_table[shared] == first_table[shared] for _, s in members):
                    shared += 1
                if shared * bs < MIN_SHARED_PREFIX:
                    shared = 0
            split = [members] if shared else [[m] for m in members]
            for part in split:
                prefix = shared * bs
                chunks = [ContextChunk(row, len(s.tokens), None if s.start == prefix else torch.tensor(
                    _slot_range(s.block_table, bs, prefix, s.start), device=dev)) for row, s in part]
                prefix_slots = torch.tensor(_slot_range(part[0][1].block_table, bs, 0, prefix), device=dev) if prefix else None
                groups.append(ContextGroup(prefix, prefix_slots, chunks))
        return groups

    def attend_layer(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: LayerKV,  # type: ignore[override]
                     meta: PagedMetadata, spec: LayerAttention, rows: torch.Tensor | None = None) -> torch.Tensor:
        """As ``AttentionBackend.attend_layer``, but a window, a soft cap or sinks run in the kernels too: every
        row goes to ``flash_prefill`` (its rows, where it runs) or the paged kernel, none to SDPA. Sinks only
        the paged kernel takes: a step with ``flash_prefill`` rows attends a layer with sinks on the general path; ALiBi,
        chunked attention and top-k key selection always do."""
        if not spec.masked or (spec.sinks is not None and meta.flash_info is not None) or spec.alibi is not None \
                or spec.chunk is not None or spec.key_select is not None:
            return super().attend_layer(q, k, v, layer_kv, meta, spec, rows)
        scale = self.scale if spec.scale is None else spec.scale
        window, softcap = spec.window or 0, spec.softcap or 0.0
        sinks = None if spec.sinks is None else spec.sinks.detach().float()
        self.pool.store(layer_kv, meta.slot_mapping, k, v)
        if q.stride(-1) != 1:
            q = q.contiguous()
        if rows is not None:
            return self._attend_rows(q, layer_kv, meta, rows, scale, window, softcap, sinks)
        out = torch.empty_like(q)
        tables, info = self._all_rows(meta)
        if info.shape[0]:
            ops.paged_attention(out, q, layer_kv[0], layer_kv[1], tables, info, self.pool.block_size, scale,
                                *self._scales(layer_kv), window=window, softcap=softcap, sinks=sinks,
                                invariant=self.invariant)
        if meta.flash_info is not None:
            ops.flash_prefill(out, q, layer_kv[0], layer_kv[1], meta.flash_tables, meta.flash_info,
                              self.pool.block_size, scale, window=window, softcap=softcap)
        return out

    def _all_rows(self, meta: PagedMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables, seq_info) of every row of the step that flash_prefill does not attend."""
        if not meta.fresh and not meta.gathered:
            return meta.block_tables, meta.seq_info
        if meta.all_rows is None:
            flash = set() if meta.flash_info is None else set(meta.flash_info[:, 0].tolist())
            tables: list[int] = []
            info: list[int] = []
            row = 0
            for s in meta.seqs:
                if row not in flash:
                    info += (row, len(s.tokens), s.end, len(tables))
                    tables += s.block_table
                row += len(s.tokens)
            meta.all_rows = torch.tensor(tables, dtype=torch.int32), torch.tensor(info, dtype=torch.int32).view(-1, 4)
        return meta.all_rows

    def _scales(self, layer_kv: LayerKV) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """An 8-bit cache's scales for the kernel (read as stored), else none."""
        return (layer_kv.k_scale, layer_kv.v_scale) if self.pool.quantized else (None, None)

    def native_step(self, meta: PagedMetadata) -> NativeAttention | None:  # type: ignore[override]
        if meta.fresh or meta.gathered or meta.flash_info is not None or not meta.seq_info.shape[0]:
            return None  # some rows go to SDPA
        return NativeAttention(meta.slot_mapping, meta.block_tables, meta.seq_info, self.pool.block_size, self.scale,
                               self.invariant)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: LayerKV, meta: PagedMetadata,
                scale: float | None = None) -> torch.Tensor:  # type: ignore[override]
        k_cache, v_cache = layer_kv
        scale = self.scale if scale is None else scale
        self.pool.store(layer_kv, meta.slot_mapping, k, v)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty_like(q)
        if meta.seq_info.shape[0]:  # an 8-bit cache is read as stored, with its scales
            ops.paged_attention(out, q, k_cache, v_cache, meta.block_tables, meta.seq_info,
                                self.pool.block_size, scale, *self._scales(layer_kv), invariant=self.invariant)
        if meta.flash_info is not None:
            ops.flash_prefill(out, q, k_cache, v_cache, meta.flash_tables, meta.flash_info,
                              self.pool.block_size, scale)
        gqa = q.shape[1] != k.shape[1]
        dt = self.prefill_dtype or q.dtype
        for first, n in meta.fresh:
            rows = slice(first, first + n)
            kf, vf = self.pool.as_stored(layer_kv, k[rows], v[rows])
            o = F.scaled_dot_product_attention(_heads_first(q[rows], dt), _heads_first(kf, dt), _heads_first(vf, dt),
                                               is_causal=True, enable_gqa=gqa, scale=scale)
            out[rows] = o[0].transpose(0, 1)
        for group in meta.gathered:
            self._attend_group(q, k, v, layer_kv, group, out, dt, scale)
        return out

    def forward_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: LayerKV, meta: PagedMetadata,
                     rows: torch.Tensor, scale: float | None = None) -> torch.Tensor:  # type: ignore[override]
        """Every row's K/V stored, then only ``rows`` attend, each run of a sequence's consecutive rows
        as one causal chunk over its context through the paged kernel (which reads the cache in place):
        what the last layer needs when the step samples a row or two per sequence."""
        self.pool.store(layer_kv, meta.slot_mapping, k, v)
        return self._attend_rows(q, layer_kv, meta, rows, self.scale if scale is None else scale)

    def _attend_rows(self, q: torch.Tensor, layer_kv: LayerKV, meta: PagedMetadata, rows: torch.Tensor, scale: float,
                     window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The attention of ``rows`` over the stored K/V, through the paged kernel."""
        tables, info = self._row_runs(meta.seqs, rows.tolist())
        out = q.new_empty(rows.numel(), q.shape[1], q.shape[2])
        if info:
            ops.paged_attention(out, q[rows], layer_kv[0], layer_kv[1], torch.tensor(tables, dtype=torch.int32),
                                torch.tensor(info, dtype=torch.int32).view(-1, 4), self.pool.block_size,
                                scale, *self._scales(layer_kv), window=window, softcap=softcap, sinks=sinks,
                                invariant=self.invariant)
        return out

    def _row_runs(self, seqs: Sequence[SeqRows], rows: list[int]) -> tuple[list[int], list[int]]:
        """The paged kernel's (tables, seq_info) for ``rows`` of the step: a run of consecutive rows of
        one sequence is one chunk whose context ends at its last row's position."""
        bs = self.pool.block_size
        firsts, first = [], 0
        for s in seqs:
            firsts.append(first)
            first += len(s.tokens)
        tables: list[int] = []
        info: list[int] = []
        i = 0
        while i < len(rows):
            s_idx = bisect.bisect_right(firsts, rows[i]) - 1
            s, j = seqs[s_idx], i + 1
            while j < len(rows) and rows[j] == rows[j - 1] + 1 and rows[j] < firsts[s_idx] + len(s.tokens):
                j += 1
            ctx = s.start + rows[j - 1] - firsts[s_idx] + 1
            info += (i, j - i, ctx, len(tables))
            tables += s.block_table[: -(-ctx // bs)]
            i = j
        return tables, info

    def _attend_group(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: LayerKV,
                      group: ContextGroup, out: torch.Tensor, dt: torch.dtype, scale: float) -> None:
        if group.prefix_slots is not None:
            q_all = torch.cat([q[c.first : c.first + c.rows] for c in group.chunks])
            kp, vp = self.pool.gather(layer_kv, group.prefix_slots, dt)
            o_prefix, lse_prefix = _attend(q_all, kp, vp, dt, scale)
        row = 0
        for c in group.chunks:
            rows = slice(c.first, c.first + c.rows)
            kf, vf = self.pool.as_stored(layer_kv, k[rows], v[rows])
            o, lse = _attend(q[rows], kf, vf, dt, scale, causal=True)
            if c.cached_slots is not None:
                kc, vc = self.pool.gather(layer_kv, c.cached_slots, dt)
                o, lse = _merge(o, lse, *_attend(q[rows], kc, vc, dt, scale))
            if group.prefix_slots is not None:
                o, lse = _merge(o, lse, o_prefix[row : row + c.rows], lse_prefix[row : row + c.rows])
            out[rows] = o
            row += c.rows


register_attention_backend("paged", PagedBackend)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, scale: float,
            causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [n, heads, d] over k, v [C, kv_heads, d] in ``dtype`` (``causal``: q and k are
    the same n positions): the output [n, heads, d] and its log-sum-exp [n, heads] (float32).

    Without a mask, the query heads that share a KV head are stacked as the rows of one
    ([kv_heads, group * n, d]): each GEMM gets group-times the rows. A causal mask follows row order,
    so there the kernel maps query heads to KV heads itself."""
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if causal:
        o, lse = sdpa(_heads_first(q, dtype), _heads_first(k, dtype), _heads_first(v, dtype), 0.0, True, scale=scale)
        return o[0].transpose(0, 1), lse[0].transpose(0, 1)
    qf = q.to(dtype).view(n, kv_heads, group, d).permute(1, 2, 0, 3).reshape(1, kv_heads, group * n, d)
    o, lse = sdpa(qf, _heads_first(k, dtype), _heads_first(v, dtype), 0.0, False, scale=scale)
    o = o.view(kv_heads, group, n, d).permute(2, 0, 1, 3).reshape(n, heads, d)
    return o, lse.view(kv_heads, group, n).permute(2, 0, 1).reshape(n, heads)


def _merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
           lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attentions of the same rows over disjoint keys as one (float32): each weighted by its
    share of the softmax's denominator, sigmoid(lse1 - lse2) for the first."""
    w1 = torch.sigmoid(lse1 - lse2).unsqueeze(-1)
    return o2.float().lerp_(o1.float(), w1), torch.logaddexp(lse1, lse2)


def _heads_first(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, heads, d] as SDPA's [1, heads, T, d], in ``dtype``."""
    return x.to(dtype).transpose(0, 1).unsqueeze(0)


def _slot_range(table: list[int], bs: int, lo: int, hi: int) -> list[int]:
    """The slots of positions [lo, hi), a block at a time."""
    out: list[int] = []
    for b in range(lo // bs, (hi - 1) // bs + 1):
        base = table[b] * bs
        out.extend(range(base + max(lo - b * bs, 0), base + min(hi - b * bs, bs)))
    return out
