"""Drafting with a smaller model that shares the target's tokenizer.

The draft model has its own paged KV cache and its own block pool, so the target's
scheduler and prefix cache never see it. Per request it remembers which tokens its cache
holds; each call first feeds what changed since (the tokens the target accepted or
emitted — after a rejection the stale tail is simply overwritten), then drafts k tokens
one forward at a time. Greedy requests get greedy drafts; sampled ones draw from the draft
model's filtered distribution, which verification needs (``Draft.probs``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kvserve.attention import DEFAULT_ATTENTION_BACKEND, SeqRows, choose_attention_backend, get_kv_pool
from kvserve.kv.block_pool import BlockPool
from kvserve.model.config import ModelConfig
from kvserve.model.decoder import CausalLM
from kvserve.runner.inputs import build_inputs
from kvserve.runner.kv_calibration import calibrate_kv_scales
from kvserve.sampling.sampler import filtered_probs, draw_one
from kvserve.spec.proposer import Draft, DraftRequest

log = logging.getLogger(__name__)


@dataclass
class _DraftSeq:
    table: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)  # tokens whose KV the draft cache holds, in order
    last_used: int = 0


class DraftProposer:
    method = "draft"

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], *, dtype: torch.dtype,
                 device: torch.device, num_blocks: int, block_size: int, seed: int = 0,
                 attention_backend: str = DEFAULT_ATTENTION_BACKEND, kv_cache_dtype: str = "auto"):
        pool_cls = get_kv_pool(kv_cache_dtype)
        backend_cls = choose_attention_backend(attention_backend, device, dtype, pool_cls.storage_dtype(dtype))
        self.model = CausalLM.from_hf_weights(cfg, weights, dtype, device)
        self.device = device
        self.block_size = block_size
        self.max_positions = cfg.max_position_embeddings
        # the same kind of KV pool and attention as the target's, over the draft model's own blocks
        self.kv_pool = pool_cls(pool_cls.layout_for(cfg, dtype, block_size), num_blocks, device)
        calibrate_kv_scales(self.model, self.kv_pool, dtype)
        self.attention = backend_cls(self.kv_pool, dtype)
        self.pool = BlockPool(num_blocks, block_size)
        self.seqs: dict[str, _DraftSeq] = {}
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._calls = 0

    def release(self, request_id: str) -> None:
        s = self.seqs.pop(request_id, None)
        if s is not None and s.table:
            self.pool.release(s.table)

    @torch.inference_mode()
    def propose(self, batch: list[DraftRequest]) -> dict[str, Draft]:
        self._calls += 1
        active: list[tuple[DraftRequest, _DraftSeq, int]] = []
        for d in batch:
            k = min(d.k, self.max_positions - len(d.token_ids))
            if k <= 0:
                continue
            s = self._prepare(d, k, {b.request.request_id for b in batch})
            if s is not None:
                active.append((d, s, k))
        if not active:
            return {}
        started = [(d, s) for d, s, _ in active]
        drafts: dict[str, list[int]] = {d.request.request_id: [] for d, _, _ in active}
        probs: dict[str, list[torch.Tensor]] = {d.request.request_id: [] for d, _, _ in active}
        # first forward: everything the draft cache lacks, up to and including the last token
        rows = [SeqRows(d.token_ids[len(s.cached):], len(s.cached), s.table) for d, s, _ in active]
        for step in range(max(k for *_, k in active)):
            if step > 0:  # then one drafted token at a time, for those that want more
                active = [(d, s, k) for d, s, k in active if k > step]
                rows = [SeqRows([drafts[d.request.request_id][-1]], len(d.token_ids) + step - 1, s.table)
                        for d, s, _ in active]
            inputs = build_inputs(rows, self.attention)
            hidden = self.model(inputs.input_ids, inputs.positions, self.attention, inputs.meta, self.kv_pool.layers)
            last = torch.tensor([inputs.offsets[i] + len(r.tokens) - 1 for i, r in enumerate(rows)], device=self.device)
            logits = self.model.logits(hidden[last])
            self._sample(logits, active, drafts, probs)
        for d, s in started:
            s.cached = d.token_ids + drafts[d.request.request_id][:-1]  # the last draft was never fed
        return {rid: Draft(toks, torch.stack(probs[rid]) if probs[rid] else None) for rid, toks in drafts.items()}

    def _sample(self, logits: torch.Tensor, active: list, drafts: dict[str, list[int]],
                probs: dict[str, list[torch.Tensor]]) -> None:
        for row, (d, _, _) in enumerate(active):
            rid = d.request.request_id
            if d.request.params.greedy:
                drafts[rid].append(int(logits[row].argmax()))
            else:
                q = filtered_probs(logits[row : row + 1], [d.request])[0]
                drafts[rid].append(draw_one(q, self.generator))
                probs[rid].append(q)

    def _prepare(self, d: DraftRequest, k: int, busy: set[str]) -> _DraftSeq | None:
        """Roll the request's draft cache back to where it still matches, and make room for the
        positions this call writes (the sequence plus k - 1 drafts); None if the pool cannot."""
        rid = d.request.request_id
        s = self.seqs.setdefault(rid, _DraftSeq())
        s.last_used = self._calls
        n = 0
        limit = min(len(s.cached), len(d.token_ids) - 1)  # the last token is always fed
        while n < limit and s.cached[n] == d.token_ids[n]:
            n += 1
        del s.cached[n:]
        need = self.pool.blocks_for(len(d.token_ids) + k - 1)
        if len(s.table) > need:
            self.pool.release(s.table[need:])
            del s.table[need:]
        short = need - len(s.table) - self.pool.num_free
        if short > 0:
            self._evict(short, busy)
        if need - len(s.table) > self.pool.num_free:
            return None
        s.table.extend(self.pool.allocate(need - len(s.table)))
        return s

    def _evict(self, blocks: int, busy: set[str]) -> None:
        """Free the draft caches of requests not drafting now, least recently used first."""
        for rid in sorted((r for r in self.seqs if r not in busy), key=lambda r: self.seqs[r].last_used):
            if blocks <= 0:
                return
            blocks -= len(self.seqs[rid].table)
            self.release(rid)
