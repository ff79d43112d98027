"""The torch runner: the model, its paged KV cache tensors, and the sampler.

It turns a Batch into flat tensors (ragged: no padding between prompts), runs one
forward, and samples only at the rows whose chunk ends a sequence.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict

import torch

from kvserve.engine.batch import Batch, ScheduledChunk, StepOutput
from kvserve.kv.manager import KVTransfer
from kvserve.model.attention import AttentionMetadata, DecodeGroup, PrefillSpan
from kvserve.model.config import ModelConfig
from kvserve.model.layers import cpu_packing_supported
from kvserve.model.llama import LlamaForCausalLM
from kvserve.sampling.sampler import Sampler

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
    ):
        self.device = torch.device(device)
        self.dtype = dtype
        self.cfg = cfg
        self.block_size = block_size

        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        model = model.to_empty(device=self.device)
        model.load_hf_weights(weights)
        self.model = model.to(dtype).eval()
        self.model.rotary.to(self.device)
        if self.device.type == "cpu" and cpu_packing_supported(dtype):
            self.model.pack_for_cpu()

        if num_kv_blocks is None:
            nbytes = int(kv_cache_memory_gb * (1 << 30)) if kv_cache_memory_gb else default_kv_cache_bytes()
            num_kv_blocks = nbytes // (kv_bytes_per_token(cfg, dtype) * block_size)
        if num_kv_blocks < 1:
            raise ValueError("the KV cache is too small to hold a single block")
        self.num_kv_blocks = num_kv_blocks
        capacity = num_kv_blocks * block_size
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings, capacity)
        # One extra, zeroed block past the pool: padded attention reads point there, so the
        # rest of the cache can stay uninitialised (never read before it is written) and the
        # OS maps its pages only as they fill.
        self.null_slot = num_kv_blocks * block_size
        shape = ((num_kv_blocks + 1) * block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = []
        for _ in range(cfg.num_hidden_layers):
            k, v = (torch.empty(shape, dtype=dtype, device=self.device) for _ in range(2))
            k[self.null_slot :].zero_()
            v[self.null_slot :].zero_()
            self.kv_caches.append((k, v))
        self.block_bytes = kv_bytes_per_token(cfg, dtype) * block_size
        self.kv_fingerprint = self._fingerprint(weights)
        self.sampler = Sampler(self.device, seed)
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

    # -- batch → tensors ---------------------------------------------------------------
    def _slots(self, chunk: ScheduledChunk, lo: int, hi: int) -> list[int]:
        bs, table = self.block_size, chunk.block_table
        return [table[p // bs] * bs + p % bs for p in range(lo, hi)]

    def _prepare(self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat inputs with the decodes' rows first, then each prefill chunk's rows."""
        dev = self.device
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for c in decodes:
            ids.append(c.request.token_ids[c.start])
            pos.append(c.start)
        meta = AttentionMetadata(slot_mapping=torch.empty(0), num_decodes=len(decodes))
        start = 0
        for end in self._decode_group_ends(decodes):
            group = decodes[start:end]
            bs = self.block_size
            ctx = torch.tensor([c.end for c in group], device=dev)
            width = max(len(c.block_table) for c in group)
            tables = torch.tensor([c.block_table + [0] * (width - len(c.block_table)) for c in group], device=dev)
            p = torch.arange(int(ctx.max()), device=dev)
            valid = p.unsqueeze(0) < ctx.unsqueeze(1)
            g_slots = torch.where(valid, tables[:, p // bs] * bs + p % bs, self.null_slot)
            meta.decode_groups.append(DecodeGroup(start, end, g_slots, valid[:, None, None, :]))
            slots.extend(g_slots[torch.arange(len(group), device=dev), ctx - 1].tolist())
            start = end
        row = len(decodes)
        for c in prefills:
            ids.extend(c.request.token_ids[c.start : c.end])
            pos.extend(range(c.start, c.end))
            slots.extend(self._slots(c, c.start, c.end))
            span = PrefillSpan(q_start=row, num_tokens=c.num_tokens)
            if c.start > 0:
                span.context_slots = torch.tensor(self._slots(c, 0, c.end), device=dev)
                k_pos = torch.arange(c.end, device=dev).unsqueeze(0)
                q_pos = torch.arange(c.start, c.end, device=dev).unsqueeze(1)
                span.mask = k_pos <= q_pos
            meta.prefills.append(span)
            row += c.num_tokens
        meta.slot_mapping = torch.tensor(slots, device=dev)
        return torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta

    @staticmethod
    def _decode_group_ends(decodes: list[ScheduledChunk]) -> list[int]:
        """Cut the decodes (sorted by context length) where padding the next one's group to its
        length would more than double the group's shortest context (and cost a gather of at least
        a few blocks): bounds the wasted gather to 2x while keeping groups few."""
        ends: list[int] = []
        lo = None
        for i, c in enumerate(decodes):
            if lo is None:
                lo = c.end
            elif c.end > 2 * lo and c.end - lo > 256:
                ends.append(i)
                lo = c.end
        if decodes:
            ends.append(len(decodes))
        return ends

    # -- one step ----------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: Batch) -> StepOutput:
        out = StepOutput()
        if batch.kv_transfers:
            self._transfer(batch.kv_transfers, out)
        if not batch.chunks:
            return out
        # decodes first, then prefills: the order _prepare lays rows out in
        decodes = sorted((c for c in batch.chunks if c.is_decode), key=lambda c: c.end)  # grouped by context
        prefills = [c for c in batch.chunks if not c.is_decode]
        input_ids, positions, meta = self._prepare(decodes, prefills)
        chunks = decodes + prefills  # the row order of the hidden states
        hidden = self.model(input_ids, positions, meta, self.kv_caches)
        rows, sampling = [], []
        row = 0
        for c in chunks:
            row += c.num_tokens
            if c.sample:
                rows.append(row - 1)
                sampling.append(c.request)
        if not rows:
            return out
        logits = self.model.logits(hidden[torch.tensor(rows, device=self.device)])
        tokens, logprobs = self.sampler(logits, sampling)
        out.token_ids = {r.request_id: t for r, t in zip(sampling, tokens)}
        out.logprobs = logprobs
        return out
