"""The torch runner: the model, its KV pool and attention backend, and the sampler.

It turns a Batch into flat tensors (ragged: no padding between prompts), runs one
forward, and samples only at the rows whose chunk ends a sequence; a verify chunk's rows
are checked against its draft. With a proposer, it then drafts the next step's tokens.
"""

from __future__ import annotations

import logging
import time

import torch

from kvserve.attention import SeqRows, choose_attention_backend, get_kv_pool
from kvserve.attention.kv_pool import resolve_kv_cache_dtype, sample_weights
from kvserve.model.checkpoint import ReleasableWeights
from kvserve.config import CacheConfig, LoRAConfig
from kvserve.engine.batch import Batch, ScheduledChunk, StepOutput
from kvserve.errors import InvalidArgumentError
from kvserve.kv.manager import KVTransfer, window_tokens
from kvserve.model.config import ModelConfig
from kvserve.model.decoder import CausalLM
from kvserve.runner.inputs import build_inputs
from kvserve.runner.kv_budget import default_kv_budget, free_memory_cap
from kvserve.runner.kv_budget import describe as describe_budget
from kvserve.runner.kv_calibration import calibrate_kv_scales
from kvserve.runner.weight_update import ModelSource, give_back_memory, load_replacement
from kvserve.sampling.sampler import Sampler, prompt_logprobs
from kvserve.spec.proposer import DraftRequest, Proposer
from kvserve.spec.verify import verify

log = logging.getLogger(__name__)

PROMPT_LOGPROBS_ROWS = 256  # prompt rows whose logits are computed at once (each row: vocab floats)


class TorchRunner:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], cache: CacheConfig, *,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                 max_model_len: int | None = None, seed: int = 0, proposer: Proposer | None = None,
                 quantization: str = "none", max_num_seqs: int = 128, max_num_batched_tokens: int = 2048,
                 lora: LoRAConfig | None = None, deterministic: bool = False):
        """``cache``: the KV cache part of the config (block size, pool size and dtype, attention backend);
        ``quantization``: which weights the model keeps quantized (``quantized_modules``);
        ``max_num_seqs`` sizes the default pool (``kv_budget``); with ``max_num_batched_tokens`` it bounds
        the row counts the start-up warm-up compiles GEMM kernels for. ``lora``: adapters served (enable_lora).
        ``deterministic``: attention whose result for a row is the same however a step is made up (the
        paged backend's ``invariant``; docs/determinism.md)."""
        self.device = torch.device(device)
        self.dtype = dtype
        self.cfg = cfg
        self.block_size = block_size = cache.block_size
        num_kv_blocks = cache.num_kv_blocks
        # deterministic: no bf16 AMX copies, whose results depend on a step's row count (AMX_MIN_ROWS)
        self.amx = False if deterministic else None
        sample = sample_weights(weights)  # before the build, which may release the checkpoint's tensors
        self.model = CausalLM.from_hf_weights(cfg, weights, dtype, self.device, quantization, self.amx)
        if isinstance(weights, ReleasableWeights):  # what the build released, back to the system before the KV is sized
            give_back_memory()
        log.info("model weights: %.2f GiB in memory (%s; %s)", self.model.weight_bytes() / (1 << 30),
                 str(dtype).removeprefix("torch."), self.model.quantization_tag() or "no quantized layers")
        # a float32 model whose many-row linears run in bf16 on AMX attends prefill in bf16 too
        bf16_prefill = dtype == torch.float32 and self.model.has_amx_weights()
        kv_name = resolve_kv_cache_dtype(cache.kv_cache_dtype, dtype, bf16_prefill)
        if kv_name != cache.kv_cache_dtype:
            log.info("KV cache dtype auto: bfloat16 (float32 model, prefill attends in bf16 on AMX; half the bytes "
                     "a decode step reads)")
        pool_cls = get_kv_pool(kv_name)
        backend_cls = choose_attention_backend(cache.attention_backend, self.device, dtype, pool_cls.storage_dtype(dtype))

        layout = pool_cls.layout_for(cfg, dtype, block_size)
        why = "--num-kv-blocks"
        # with a window on every layer a sequence holds its window's blocks and a chunk's, whatever its length
        window = cfg.kv_window()
        held = None if window is None else window_tokens(window, block_size, max_num_batched_tokens)
        if num_kv_blocks is None and not layout.block_bytes:  # no layer attends: blocks only map positions
            model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
            num_kv_blocks, why = max_num_seqs * -(-model_len // block_size), "no layer keeps KV"
        elif num_kv_blocks is None and cache.kv_cache_memory_gb:
            num_kv_blocks, why = int(cache.kv_cache_memory_gb * (1 << 30)) // layout.block_bytes, "--kv-cache-memory-gb"
        elif num_kv_blocks is None:
            model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
            seq_len = model_len if held is None else min(model_len, held)
            budget = default_kv_budget(layout.block_bytes // block_size, seq_len, max_num_seqs, self.device)
            num_kv_blocks, why = budget.nbytes // layout.block_bytes, describe_budget(budget, seq_len, max_num_seqs,
                                                                                 windowed=seq_len != model_len)
        if num_kv_blocks < 1:
            raise InvalidArgumentError(f"the KV cache is too small to hold a single block of {block_size} tokens "
                                       f"({layout.block_bytes} bytes): raise --kv-cache-memory-gb or --num-kv-blocks")
        self.num_kv_blocks = num_kv_blocks
        capacity = num_kv_blocks * block_size
        if held is not None and capacity >= held:
            capacity = cfg.max_position_embeddings  # one sequence alone always progresses: no cap on its length
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings, capacity)
        log.info("allocating %d KV blocks of %d tokens (%.2f GiB, %s, %d bytes per token; --kv-cache-dtype %s): %s",
                 num_kv_blocks, block_size, num_kv_blocks * layout.block_bytes / (1 << 30), layout.dtype,
                 layout.bytes_per_token, kv_name, why)
        self.kv_pool = pool_cls(layout, num_kv_blocks, self.device)
        # a recurrent state for each sequence that may run at once (the KV manager hands out the slots), as many as
        # --max-num-seqs where memory allows (the KV cache's own cap), else fewer: the scheduler then runs fewer at once
        self.num_state_slots = 0
        if cfg.has_recurrent_state:
            per_slot = self.model.state_bytes(dtype)
            cap, reason = free_memory_cap(self.device)
            self.num_state_slots = max(1, min(max_num_seqs, cap // per_slot))
            self.model.allocate_states(self.num_state_slots, dtype, self.device)
            capped = f"; --max-num-seqs {max_num_seqs} capped at {reason}" if self.num_state_slots < max_num_seqs else ""
            log.info("recurrent state: %d slots of %.2f MiB (%.2f GiB)%s", self.num_state_slots, per_slot / (1 << 20),
                     self.num_state_slots * per_slot / (1 << 30), capped)
        calibrate_kv_scales(self.model, self.kv_pool, dtype)  # an 8-bit pool's scales, before any token
        self.attention = backend_cls(self.kv_pool, dtype)
        self.deterministic = deterministic
        if deterministic:
            if hasattr(self.attention, "invariant"):
                self.attention.invariant = True
            else:
                log.warning("--deterministic: the %s attention backend is not batch-invariant (the paged one is): "
                            "answers may depend on the batch and on prefix hits", type(self.attention).__name__)
        if bf16_prefill:
            self.attention.prefill_dtype = torch.bfloat16
            flash = getattr(self.attention, "flash_prefill", lambda: False)()
            log.info("prefill attention: bfloat16 %s (AMX; the many-row linears run in bf16 too; KVSERVE_AMX=0 "
                     "keeps both in float32)", "flash_prefill (AMX brgemm)" if flash else "SDPA")
        self.attention.warm_up(cfg.num_attention_heads)
        self.quantization = quantization
        self._warm_rows = (max_num_batched_tokens, max_num_seqs)
        self._warm_up(self.model)
        self.block_bytes = self.kv_pool.block_bytes  # what a tier stores per block (an 8-bit pool's scales too)
        self.kv_bytes_per_token = layout.bytes_per_token
        self.kv_fingerprint = self.kv_pool.fingerprint(cfg, sample, dtype, self.model.quantization_tag())
        self.sampler = Sampler(self.device, seed)
        self.seed = seed
        self.proposer = proposer
        self._draft_probs: dict[str, torch.Tensor] = {}  # a sampled draft's distributions, until verified
        self.lora = None
        if lora is not None and lora.enable_lora:
            from kvserve.lora.manager import LoRAManager

            self.lora = LoRAManager(cfg, lora, self.model, dtype)
        self.source: ModelSource | None = None  # where the weights came from (the builder sets it)

    def _warm_up(self, model: CausalLM) -> None:
        if self.device.type == "cpu":
            started = time.perf_counter()
            kernels = model.warm_up(*self._warm_rows)
            if kernels:
                log.info("warm-up: %d AMX GEMM kernels compiled in %.2f s", kernels, time.perf_counter() - started)

    # -- sleep, wake, new weights: between steps, with no sequence in the pool (kvserve.engine.model_ops) ----
    def sleep(self, level: int) -> None:
        """Level 1: free the KV cache's tensors; level 2: the model's weights too (``wake_up`` loads them
        again from ``source``)."""
        if level >= 2 and self.source is None:
            raise InvalidArgumentError("sleep level 2 reloads the weights from disk on wake, and this model was "
                                       "not loaded from a path: use level 1", param="level")
        self.kv_pool.release()
        self.model.allocate_states(0, self.dtype, self.device)
        self._draft_probs.clear()
        if level >= 2:
            self.model = None  # type: ignore[assignment]
        give_back_memory()

    def wake_up(self) -> None:
        if self.model is None:
            assert self.source is not None
            self._use_model(*load_replacement(self.source, self.cfg, self.max_model_len, self.quantization))
        self.kv_pool.reallocate()
        self.model.allocate_states(self.num_state_slots, self.dtype, self.device)

    def load_weights(self, model_path: str, load_format: str = "auto") -> None:
        """Serve the checkpoint at ``model_path`` (``load_replacement``'s checks) from the next step on; the
        served weights stay if it is refused or fails to load."""
        source = ModelSource(model_path, load_format, self.seed)
        self._use_model(*load_replacement(source, self.cfg, self.max_model_len, self.quantization))
        self.source = source

    def _use_model(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        sample = sample_weights(weights)
        model = CausalLM.from_hf_weights(cfg, weights, self.dtype, self.device, self.quantization, self.amx)
        calibrate_kv_scales(model, self.kv_pool, self.dtype)  # an 8-bit pool's scales follow the weights
        self._warm_up(model)
        model.allocate_states(self.num_state_slots, self.dtype, self.device)
        self.model, self.cfg = model, cfg
        if self.lora is not None:
            self.lora.rebind(model)
        self.kv_fingerprint = self.kv_pool.fingerprint(cfg, sample, self.dtype, model.quantization_tag())
        give_back_memory()  # the old model's

    def _transfer(self, transfers: list[KVTransfer], out: StepOutput) -> None:
        """Copy blocks to and from the offload tiers, in order (a block may be saved, then reused);
        ``send`` copies are read like saves, for the KV connector."""
        for t in transfers:
            if t.kind != "load":
                out.saved_kv[t.key] = self.kv_pool.read_block(t.block)
            else:
                assert t.payload is not None
                self.kv_pool.write_block(t.block, t.payload)

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
        seqs = [SeqRows(c.input_token_ids, c.start, c.block_table, c.state_slot) for c in chunks]
        inputs = build_inputs(seqs, self.attention)
        # the rows to score: a sampling chunk's last row; all 1 + k rows of a verify chunk
        rows: list[int] = []
        first_row: dict[int, int] = {}  # sampling chunk -> its first row in ``logits``
        sampling = [i for i in inputs.order if chunks[i].sample]
        for i in sampling:
            c, first = chunks[i], inputs.offsets[i]
            n = 1 + len(c.draft_token_ids)
            first_row[i] = len(rows)
            rows.extend(range(first + c.num_tokens - n, first + c.num_tokens))
        # the model's last layer for those rows only, unless prompt logprobs read every row (or they are all)
        all_rows = any(c.request.needs_prompt_logprobs for c in chunks)
        keep = None if all_rows or len(rows) == len(inputs.input_ids) else \
            torch.tensor(rows, dtype=torch.long, device=self.device)
        if self.lora is not None:  # each row's adapter (None: the base model)
            refs = [chunks[i].request.lora for i in inputs.order for _ in seqs[i].tokens]
            self.model.lora.step = self.lora.step(refs, None if keep is None else rows)
        try:
            hidden = self.model(inputs.input_ids, inputs.positions, self.attention, inputs.meta, self.kv_pool.layers,
                                keep_rows=keep)
        finally:
            if self.lora is not None:
                self.model.lora.step = None
        if all_rows:
            self._prompt_logprobs(hidden, chunks, inputs.offsets, out)
        if not rows:
            return out
        scored = [chunks[i] for i in sampling]
        constrained = any(c.request.grammar is not None for c in scored)
        reqs = [c.request for c in scored]
        # an AMX LM head's bf16 logits go to the sampler as they are when only its native draws read them
        keep_bf16 = not constrained and not any(c.is_verify for c in scored) and self.sampler.reads_bf16(reqs)
        hidden = hidden if keep is not None else hidden[torch.tensor(rows, device=self.device)]
        if keep_bf16 and self.model.draws_in_head(hidden):
            # every row one token, greedy or plain temperature: the head draws them, no logits
            tokens = self.model.draw_in_head(hidden, *self.sampler.head_draw_inputs(reqs)).tolist()
            for r, t in zip(reqs, tokens):
                out.token_ids[r.request_id] = [t]
                self._draft_probs.pop(r.request_id, None)
            if self.proposer is not None:
                self._propose(scored, out)
            return out
        logits = self.model.logits(hidden, keep_bf16=keep_bf16)
        if constrained:  # kvserve.structured (and xgrammar) load only once a request has a grammar
            from kvserve.structured.masking import advance_grammars, apply_grammar_masks

            num_drafts = apply_grammar_masks(logits, scored)
        else:
            num_drafts = {}
        plain = [i for i in sampling if not chunks[i].is_verify]
        if plain:
            at = [first_row[i] for i in plain]
            plain_reqs = [chunks[i].request for i in plain]
            plain_logits = logits if len(at) == len(rows) else logits[torch.tensor(at, device=self.device)]
            tokens, logprobs = self.sampler(plain_logits, plain_reqs)
            for r, t in zip(plain_reqs, tokens):
                out.token_ids[r.request_id] = [t]
                if r.request_id in logprobs:
                    out.logprobs[r.request_id] = [logprobs[r.request_id]]
        for i in sampling:
            c, r, row = chunks[i], chunks[i].request, first_row[i]
            q = self._draft_probs.pop(r.request_id, None)  # this step replaces the draft either way
            if c.is_verify:
                k = num_drafts.get(r.request_id, len(c.draft_token_ids))  # a grammar may have cut the draft short
                tokens, lps = verify(logits[row : row + k + 1], c.draft_token_ids[:k], None if q is None else q[:k],
                                     r, self.sampler.generator(r), self.sampler.processing)
                out.token_ids[r.request_id] = tokens
                if lps:
                    out.logprobs[r.request_id] = lps
        if constrained:
            advance_grammars(scored, out.token_ids)
        if self.proposer is not None:
            self._propose(scored, out)
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, chunks: list[ScheduledChunk], offsets: list[int],
                         out: StepOutput) -> None:
        """The logprobs of the prompt tokens that the rows of each chunk asking for them predict
        (row j predicts the token at position start + j + 1), the ones not computed before: a
        preempted request runs its prompt again, and keeps what it had."""
        for i, c in enumerate(chunks):
            r = c.request
            if not r.needs_prompt_logprobs:
                continue
            first = max(c.start + 1, len(r.prompt_logprobs) + 1)  # positions of the targets
            last = min(c.end, r.num_prompt_tokens - 1)
            if first > last:
                continue
            got = []
            for lo in range(first, last + 1, PROMPT_LOGPROBS_ROWS):  # bounded memory: rows x vocab floats
                hi = min(lo + PROMPT_LOGPROBS_ROWS, last + 1)
                rows = hidden[offsets[i] + lo - 1 - c.start : offsets[i] + hi - 1 - c.start]
                got += prompt_logprobs(self.model.logits(rows), r.token_ids[lo:hi], r.params.prompt_logprobs or 0)
            out.prompt_logprobs[r.request_id] = got

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

