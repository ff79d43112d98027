"""Attention with a sliding window, a soft cap on its scores or sinks (Mistral, Gemma 2/3, Phi-3, gpt-oss): in
torch, over each sequence's context gathered from the cache, with the scores computed, capped and masked
explicitly.

The fallback for such layers (``AttentionBackend.attend_layer``): the paged backend attends them in its
native kernels, which take the window, the cap and sinks (``PagedBackend.attend_layer``; sinks only in
steps without ``flash_prefill`` rows); other backends (``gather-sdpa``, or no native kernels) send them here. Layers without these options (window, cap, sinks) keep the backends'
kernels. The context a windowed layer gathers starts where its first row's window does, so a long
context costs the window, not its length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.attention.kv_pool import KVPool, LayerKV


@dataclass(frozen=True)
class LayerAttention:
    """A layer's own attention options (None: the default): the softmax scale (default head_dim ** -0.5),
    a sliding window (the query's key and the window - 1 before it), a soft cap on the scores
    (cap * tanh(score / cap)), sinks: one logit per query head that joins the softmax's denominator and
    attends no value (gpt-oss), a [heads] tensor; ALiBi's slopes, a [heads] tensor: each score plus its head's slope
    times the key's distance behind the query (Bloom, MPT); a chunk: the query attends only the keys of its chunk
    (Llama 4)."""

    scale: float | None = None
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    alibi: torch.Tensor | None = None
    chunk: int | None = None  # Llama 4's chunked attention: keys in the query's chunk of this many positions only
    key_select: "TopKKeys | None" = None  # each query attends only its top-k keys by an index score (DeepSeek-V3.2)

    @property
    def masked(self) -> bool:
        """Whether the layer needs the general path (``kvserve.attention.general``)."""
        return (self.window is not None or self.softcap is not None or self.sinks is not None or self.alibi is not None
                or self.chunk is not None or self.key_select is not None)


@dataclass
class TopKKeys:
    """A step's choice of keys by a lightning indexer (DeepSeek Sparse Attention): query i keeps the ``topk`` causal keys
    j with the best score sum_h weights[i, h] * relu(scale * queries[i, h] . key_j) (all of them where it has fewer);
    the index keys are ``queries.shape[-1]`` values from ``offset`` in each slot's K (``half`` 0) or V (1) row of pool
    layer ``layer`` (``kvserve.model.index_cache``). Each sequence's choice is computed once and kept, so that layers
    sharing the choice reuse it. Scores tied exactly at the k-th place (relu zeroes all of a key's heads) are broken by
    ``topk`` as transformers' are, over this step's context: a prompt split into other chunks may keep another of the
    tied keys."""

    queries: torch.Tensor  # [T, heads, dim], rotated
    weights: torch.Tensor  # [T, heads], float32
    layer: LayerKV
    topk: int
    scale: float
    half: int = 0
    offset: int = 0
    _kept: dict[int, torch.Tensor] = field(default_factory=dict)

    def keep(self, pool: KVPool, index: int, ctx: "_SeqContext", allowed: torch.Tensor) -> torch.Tensor:
        """[n, C] bool: the keys each of the context's rows attends (``allowed``: its causal ones)."""
        if index in self._kept:
            return self._kept[index]
        if allowed.shape[1] <= self.topk:
            kept = torch.ones_like(allowed)
        else:
            dim = self.queries.shape[-1]
            keys = pool.gather(self.layer, ctx.slots, torch.float32)[self.half]
            keys = keys.reshape(keys.shape[0], -1)[:, self.offset : self.offset + dim]
            q = self.queries[ctx.rows].float()
            scores = torch.relu(torch.matmul(q, keys.t()) * self.scale)  # [n, heads, C]
            index_scores = torch.matmul(self.weights[ctx.rows].unsqueeze(-2), scores).squeeze(-2)
            index_scores = index_scores.masked_fill(~allowed, float("-inf"))
            best = index_scores.topk(self.topk, dim=-1).indices
            kept = torch.zeros_like(allowed).scatter_(1, best, True)
        self._kept[index] = kept
        return kept


@dataclass
class _SeqContext:
    rows: slice  # the sequence's rows in the step
    slots: torch.Tensor  # its context's slots, from position first
    first: int
    start: int  # position of its first row


def _contexts(pool: KVPool, meta: Any, window: int | None) -> list[_SeqContext]:
    """Per sequence the slots its rows attend (from its first row's window on), computed once per step
    and window and kept on the step's metadata."""
    cache = meta.__dict__.setdefault("_general_contexts", {})
    if window in cache:
        return cache[window]
    bs, out, row = pool.block_size, [], 0
    for s in meta.seqs:
        first = 0 if window is None else max(0, s.start - window + 1)
        slots = [s.block_table[p // bs] * bs + p % bs for p in range(first, s.end)]
        out.append(_SeqContext(slice(row, row + len(s.tokens)), torch.tensor(slots, device=pool.device), first, s.start))
        row += len(s.tokens)
    cache[window] = out
    return out


def attend_general(pool: KVPool, q: torch.Tensor, layer_kv: LayerKV, meta: Any, spec: LayerAttention) -> torch.Tensor:
    """q: [T, heads, d], the step's rows (their K/V already stored); ``meta``: the step's
    ``AttentionMetadata`` (its ``seqs``); returns [T, heads, d]."""
    out = torch.empty_like(q)
    heads, d = q.shape[1], q.shape[2]
    scale = spec.scale if spec.scale is not None else d**-0.5
    for i, ctx in enumerate(_contexts(pool, meta, spec.window)):
        qs = q[ctx.rows].float()  # [n, heads, d]
        k, v = pool.gather(layer_kv, ctx.slots, torch.float32)  # [C, kv_heads, d]
        group = heads // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,chd->hnc", qs, k) * scale
        if spec.softcap is not None:
            scores = torch.tanh(scores / spec.softcap) * spec.softcap
        q_pos = torch.arange(ctx.start, ctx.start + qs.shape[0], device=q.device)[:, None]
        k_pos = torch.arange(ctx.first, ctx.first + k.shape[0], device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if spec.alibi is not None:  # slope x (key - query), 0 on the query's own key, more negative the further back
            scores = scores + spec.alibi.float()[:, None, None] * (k_pos - q_pos)[None]
        if spec.window is not None:
            allowed &= k_pos > q_pos - spec.window
        if spec.chunk is not None:
            allowed &= k_pos // spec.chunk == q_pos // spec.chunk
        if spec.key_select is not None:
            allowed &= spec.key_select.keep(pool, i, ctx, allowed)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if spec.sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:  # the sink is one more logit per head in the softmax, whose probability is dropped
            sink = spec.sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out[ctx.rows] = torch.einsum("hnc,chd->nhd", probs, v).to(q.dtype)
    return out
