"""The torch runner: the model, its paged KV cache tensors, and the sampler.

It turns a Batch into flat tensors (ragged: no padding between prompts), runs one
forward, and samples only at the rows whose chunk ends a sequence; a verify chunk's rows
are checked against its draft. With a proposer, it then drafts the next step's tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict

import torch

from kvserve.engine.batch import Batch, ScheduledChunk, StepOutput
from kvserve.kv.manager import KVTransfer
from kvserve.model.attention import allocate_kv_caches
from kvserve.model.config import ModelConfig
from kvserve.model.llama import LlamaForCausalLM
from kvserve.runner.inputs import SeqRows, build_inputs
from kvserve.sampling.sampler import Sampler
from kvserve.spec.proposer import DraftRequest, Proposer
from kvserve.spec.verify import verify

log = logging.getLogger(__name__)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem


def default_kv_cache_bytes() -> int:
    """Without --kv-cache-memory-gb: a quarter of available memory, at most 4 GiB."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        avail = info.get("MemAvailable", 8 << 30)
    except OSError:
        avail = 8 << 30
    return int(min(4 << 30, avail // 4))


class TorchRunner:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        block_size: int = 16,
        kv_cache_memory_gb: float | None = None,
        num_kv_blocks: int | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        proposer: Proposer | None = None,
    ):
        self.device = torch.device(device)
        self.dtype = dtype
        self.cfg = cfg
        self.block_size = block_size

        self.model = LlamaForCausalLM.from_hf_weights(cfg, weights, dtype, self.device)

        if num_kv_blocks is None:
            nbytes = int(kv_cache_memory_gb * (1 << 30)) if kv_cache_memory_gb else default_kv_cache_bytes()
            num_kv_blocks = nbytes // (kv_bytes_per_token(cfg, dtype) * block_size)
        if num_kv_blocks < 1:
            raise ValueError("the KV cache is too small to hold a single block")
        self.num_kv_blocks = num_kv_blocks
        capacity = num_kv_blocks * block_size
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings, capacity)
        self.kv_caches, self.null_slot = allocate_kv_caches(cfg.num_hidden_layers, num_kv_blocks, block_size,
                                                            cfg.num_key_value_heads, cfg.head_dim, dtype, self.device)
        self.block_bytes = kv_bytes_per_token(cfg, dtype) * block_size
        self.kv_fingerprint = self._fingerprint(weights)
        self.sampler = Sampler(self.device, seed)
        self.proposer = proposer
        self._draft_probs: dict[str, torch.Tensor] = {}  # a sampled draft's distributions, until verified
        log.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_kv_blocks, block_size,
                 num_kv_blocks * block_size * kv_bytes_per_token(cfg, dtype) / (1 << 30))

    def _fingerprint(self, weights: dict[str, torch.Tensor]) -> bytes:
        """Identifies the model and the KV layout, so stored KV never meets another model."""
        h = hashlib.blake2b(digest_size=16)
        h.update(json.dumps(asdict(self.cfg), sort_keys=True, default=str).encode())
        h.update(f"{self.dtype}|{self.block_size}|{self.cfg.num_key_value_heads}x{self.cfg.head_dim}".encode())
        for name in sorted(weights)[:4]:  # a sample of the weights themselves
            h.update(name.encode())
            h.update(weights[name].flatten()[:4096].float().cpu().numpy().tobytes())
        return h.digest()

    # -- offload tiers ---------------------------------------------------------------------
    def _block_slots(self, block: int) -> slice:
        return slice(block * self.block_size, (block + 1) * self.block_size)

    def _transfer(self, transfers: list[KVTransfer], out: StepOutput) -> None:
        """Copy blocks to and from the tiers, in order (a block may be saved, then reused)."""
        for t in transfers:
            s = self._block_slots(t.block)
            if t.kind == "save":
                data = torch.stack([c[s] for kv in self.kv_caches for c in kv]).cpu()
                out.saved_kv[t.key] = data.view(torch.uint8).numpy().tobytes()
            else:
                assert t.payload is not None and len(t.payload) == self.block_bytes
                data = torch.frombuffer(bytearray(t.payload), dtype=torch.uint8).view(self.dtype)
                data = data.view(2 * len(self.kv_caches), self.block_size, *self.kv_caches[0][0].shape[1:])
                for i, kv in enumerate(self.kv_caches):
                    kv[0][s].copy_(data[2 * i])
                    kv[1][s].copy_(data[2 * i + 1])

    # -- one step ----------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: Batch) -> StepOutput:
        out = StepOutput()
        for rid in batch.finished_request_ids:
            self._draft_probs.pop(rid, None)
            if self.proposer is not None:
                self.proposer.release(rid)
        if batch.kv_transfers:
            self._transfer(batch.kv_transfers, out)
        if not batch.chunks:
            return out
        chunks = batch.chunks
        seqs = [SeqRows(c.input_token_ids, c.start, c.block_table) for c in chunks]
        inputs = build_inputs(seqs, self.block_size, self.null_slot, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
        # the rows to score: a sampling chunk's last row; all 1 + k rows of a verify chunk
        rows: list[int] = []
        first_row: dict[int, int] = {}  # sampling chunk -> its first row in ``logits``
        sampling = [i for i in inputs.order if chunks[i].sample]
        for i in sampling:
            c, first = chunks[i], inputs.offsets[i]
            n = 1 + len(c.draft_token_ids)
            first_row[i] = len(rows)
            rows.extend(range(first + c.num_tokens - n, first + c.num_tokens))
        if not rows:
            return out
        logits = self.model.logits(hidden[torch.tensor(rows, device=self.device)])
        num_drafts = self._apply_grammars(logits, [chunks[i] for i in sampling])
        plain = [i for i in sampling if not chunks[i].is_verify]
        if plain:
            at = [first_row[i] for i in plain]
            reqs = [chunks[i].request for i in plain]
            tokens, logprobs = self.sampler(logits[torch.tensor(at, device=self.device)], reqs)
            for r, t in zip(reqs, tokens):
                out.token_ids[r.request_id] = [t]
                if r.request_id in logprobs:
                    out.logprobs[r.request_id] = [logprobs[r.request_id]]
        for i in sampling:
            c, r, row = chunks[i], chunks[i].request, first_row[i]
            q = self._draft_probs.pop(r.request_id, None)  # this step replaces the draft either way
            if c.is_verify:
                k = num_drafts.get(r.request_id, len(c.draft_token_ids))  # a grammar may have cut the draft short
                tokens, lps = verify(logits[row : row + k + 1], c.draft_token_ids[:k], None if q is None else q[:k],
                                     r, self.sampler.generator(r))
                out.token_ids[r.request_id] = tokens
                if lps:
                    out.logprobs[r.request_id] = lps
        for i in sampling:  # the grammars take the tokens sampled under their masks
            m = chunks[i].request.grammar
            if m is not None:
                for t in out.token_ids[chunks[i].request.request_id]:
                    if m.is_terminated() or not m.accept(t):
                        break
        if self.proposer is not None:
            self._propose([chunks[i] for i in sampling], out)
        return out

    def _apply_grammars(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> dict[str, int]:
        """Mask the scored rows of constrained requests to what their grammar allows (``logits``
        holds each chunk's rows in turn: one, or 1 + k for a verify). A draft is checked first: the
        grammar's valid prefix of it is verified, each of its rows masked with the grammar state
        after the drafts before it. Returns {request id: drafts kept} for cut drafts."""
        if all(c.request.grammar is None for c in chunks):
            return {}
        from kvserve.structured import allocate_bitmask, apply_masks

        bitmask = allocate_bitmask(logits.shape[0], logits.shape[1])
        masked: list[int] = []
        kept: dict[str, int] = {}
        row = 0
        for c in chunks:
            m, drafts = c.request.grammar, c.draft_token_ids
            if m is not None and not m.is_terminated():
                k = m.validate_tokens(drafts) if drafts else 0
                taken = 0
                for j in range(k + 1):
                    if m.is_terminated():  # a drafted stop token: the rows after it are not verified
                        k = j
                        break
                    m.fill_mask(bitmask, row + j)
                    masked.append(row + j)
                    if j < k:
                        m.accept(drafts[j])
                        taken += 1
                m.rollback(taken)
                if k < len(drafts):
                    kept[c.request.request_id] = k
            row += 1 + len(drafts)
        apply_masks(logits, bitmask, masked)
        return kept

    def _propose(self, chunks: list[ScheduledChunk], out: StepOutput) -> None:
        """Draft the next step's tokens for the chunks the scheduler asked it of."""
        want = [DraftRequest(c.request, c.request.token_ids + out.token_ids[c.request.request_id], c.propose_k)
                for c in chunks if c.propose_k > 0]
        if not want:
            return
        assert self.proposer is not None
        for rid, draft in self.proposer.propose(want).items():
            out.draft_token_ids[rid] = draft.token_ids
            if draft.probs is not None:
                self._draft_probs[rid] = draft.probs

