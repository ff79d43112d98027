"""The offline Python API: ``LLM(...).generate(prompts, params)`` and ``LLM.chat(messages)``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.output import OutputProcessor, RequestOutput
from kvserve.engine.request import SamplingParams
from kvserve.engine.scheduler import SchedulerConfig
from kvserve.errors import InvalidArgumentError, ModelLoadError
from kvserve.kv.manager import KVManager
from kvserve.kv.tiers import DiskTier, HostTier
from kvserve.model.config import ModelConfig
from kvserve.runner.torch_runner import TorchRunner
from kvserve.spec.draft import DraftProposer
from kvserve.spec.ngram import NgramProposer
from kvserve.spec.proposer import Proposer

PromptLike = str | list[int]


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidArgumentError("--device cuda was asked for, but torch sees no CUDA device", param="device")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """``auto`` picks bfloat16 only where matmuls run natively in it.

    On a CPU without AVX512-BF16 or AMX, oneDNN emulates bf16 and a bf16 GEMM is several
    times slower than float32 (measured 7x on this project's AVX2 machines).
    """
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.startswith("cuda"):
        return torch.bfloat16
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def build_engine(cfg: EngineConfig, model_cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 eos_token_ids: list[int], draft_weights: tuple[ModelConfig, dict[str, torch.Tensor]] | None = None,
                 hf_tokenizer: Any = None) -> Engine:
    """The torch runner and the engine loop around it, from a config and loaded weights.
    ``draft_weights`` stands in for loading ``--speculative-model`` (tests pass tiny models);
    ``hf_tokenizer`` (a transformers tokenizer) enables structured output."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    runner = TorchRunner(
        model_cfg,
        weights,
        dtype=dtype,
        device=device,
        block_size=cfg.block_size,
        kv_cache_memory_gb=cfg.kv_cache_memory_gb,
        num_kv_blocks=cfg.num_kv_blocks,
        max_model_len=cfg.max_model_len,
        seed=cfg.seed,
        attention_backend=cfg.attention_backend,
        kv_cache_dtype=cfg.kv_cache_dtype,
    )
    runner.proposer = build_proposer(cfg, model_cfg, runner, draft_weights)
    sched = SchedulerConfig(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                            prefill_step_factor=cfg.prefill_step_factor,
                            metered_prefill_min_tokens=cfg.metered_prefill_min_tokens, schedule_policy=cfg.schedule_policy,
                            starvation_timeout_s=cfg.starvation_timeout_s,
                            num_speculative_tokens=cfg.num_speculative_tokens if runner.proposer else 0,
                            adaptive_speculation=cfg.adaptive_speculation)
    def grammars():  # built on first use: describing the vocabulary to xgrammar takes ~0.5 s
        from kvserve.structured import GrammarCache

        return GrammarCache.from_tokenizer(hf_tokenizer, model_cfg.vocab_size, list(eos_token_ids),
                                           max_size=cfg.grammar_cache_size,
                                           compile_timeout_s=cfg.grammar_compile_timeout_s or None)

    return Engine(runner, sched, vocab_size=model_cfg.vocab_size, eos_token_ids=tuple(eos_token_ids),
                  kv=build_kv_manager(cfg, runner.num_kv_blocks, runner.block_size, runner.block_bytes,
                                      runner.kv_fingerprint), grammars=grammars if hf_tokenizer is not None else None)


def build_proposer(cfg: EngineConfig, model_cfg: ModelConfig, runner: TorchRunner,
                   draft_weights: tuple[ModelConfig, dict[str, torch.Tensor]] | None) -> Proposer | None:
    if cfg.speculative_method == "ngram":
        return NgramProposer(cfg.ngram_min, cfg.ngram_max)
    if cfg.speculative_method != "draft":
        return None
    if draft_weights is None:
        from kvserve.model.loader import load_model, resolve_model_path

        loaded = load_model(resolve_model_path(cfg.speculative_model))
        draft_weights = (loaded.config, loaded.weights)
    draft_cfg, weights = draft_weights
    if draft_cfg.vocab_size != model_cfg.vocab_size:
        raise ModelLoadError(f"the draft model's vocabulary has {draft_cfg.vocab_size} tokens and the target's "
                             f"{model_cfg.vocab_size}: a draft model must share the target's tokenizer")
    return DraftProposer(draft_cfg, weights, dtype=runner.dtype, device=runner.device,
                         num_blocks=runner.num_kv_blocks, block_size=runner.block_size, seed=cfg.seed,
                         attention_backend=cfg.attention_backend, kv_cache_dtype=cfg.kv_cache_dtype)


def build_kv_manager(cfg: EngineConfig, num_blocks: int, block_size: int, block_bytes: int,
                     fingerprint: bytes) -> KVManager:
    """The KV manager with the prefix cache and the offload tiers the config asks for."""
    tiers: list[HostTier | DiskTier] = []
    if cfg.kv_offload_memory_gb:
        tiers.append(HostTier(int(cfg.kv_offload_memory_gb * (1 << 30))))
    if cfg.kv_offload_dir:
        tiers.append(DiskTier(cfg.kv_offload_dir, int(cfg.kv_offload_disk_gb * (1 << 30)), fingerprint))
    return KVManager(num_blocks, block_size, enable_prefix_caching=cfg.enable_prefix_caching, tiers=tiers,
                     fingerprint=fingerprint, block_bytes=block_bytes)


class LLM:
    """Generate from a model in this process. With no ``model``, the embedded SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, **engine_args: Any):
        from kvserve.model.loader import load_model, resolve_model_path
        from kvserve.model.tokenizer import Tokenizer

        self.config = EngineConfig.from_kwargs(model=model, **engine_args)
        loaded = load_model(resolve_model_path(model))
        self.tokenizer = Tokenizer(loaded.tokenizer, loaded.config)
        self.model_name = loaded.name
        self.engine = build_engine(self.config, loaded.config, loaded.weights, self.tokenizer.eos_token_ids,
                                   hf_tokenizer=loaded.tokenizer)
        self._ids = itertools.count()

    @classmethod
    def from_weights(cls, model_config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer=None,
                     draft: tuple[ModelConfig, dict[str, torch.Tensor]] | None = None, **engine_args: Any) -> "LLM":
        """An LLM over weights already in memory (tests use tiny random models this way)."""
        self = cls.__new__(cls)
        self.config = EngineConfig.from_kwargs(**engine_args)
        self.tokenizer = tokenizer
        self.model_name = "in-memory"
        eos = tokenizer.eos_token_ids if tokenizer is not None else model_config.eos_token_ids
        self.engine = build_engine(self.config, model_config, weights, eos, draft,
                                   hf_tokenizer=tokenizer.hf if tokenizer is not None else None)
        self._ids = itertools.count()
        return self

    # -- inputs -----------------------------------------------------------------------
    def _encode(self, prompt: PromptLike) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgumentError("this model has no tokenizer: pass token ids", param="prompt")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise InvalidArgumentError("a prompt must be a string or a list of token ids", param="prompt")

    @staticmethod
    def _as_list(prompts: PromptLike | Sequence[PromptLike]) -> list[PromptLike]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]
        return list(prompts)

    # -- generation -------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion in continuous batches; outputs in prompt order."""
        items = self._as_list(prompts)
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(items)
        if len(plist) != len(items):
            raise InvalidArgumentError("give one SamplingParams, or one per prompt")
        encoded = [self._encode(p) for p in items]
        finals: dict[str, RequestOutput] = {}
        order: list[str] = []
        processor = OutputProcessor(self.tokenizer)
        try:
            for ids, p in zip(encoded, plist):
                rid = str(next(self._ids))
                processor.add(self.engine.add_request(rid, ids, p))
                order.append(rid)
            bar = None
            if use_tqdm:
                from tqdm import tqdm

                bar = tqdm(total=len(order), desc="requests", unit="req")
            while self.engine.has_unfinished():
                for out in self._step(processor):
                    if out.finished:
                        finals[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
            if bar is not None:
                bar.close()
        except BaseException:
            for rid in order:  # leave no half-run request behind (Ctrl-C, errors)
                self.engine.abort(rid)
            raise
        for rid, text in zip(order, items):
            finals[rid].prompt = text if isinstance(text, str) else None
        return [finals[rid] for rid in order]

    def _step(self, processor: OutputProcessor) -> list[RequestOutput]:
        outs = []
        for req in self.engine.step():
            out, stopped = processor.process(req)
            if stopped:
                self.engine.finish(req.request_id, req.finish_reason, req.stop_reason)
            outs.append(out)
        return outs

    def stream(self, prompt: PromptLike, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield one output per new token for a single prompt (for terminals and tests)."""
        processor = OutputProcessor(self.tokenizer)
        rid = str(next(self._ids))
        processor.add(self.engine.add_request(rid, self._encode(prompt), params or SamplingParams()))
        try:
            while self.engine.has_unfinished():
                for out in self._step(processor):
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(rid)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        if self.tokenizer is None:
            raise InvalidArgumentError("this model has no tokenizer or chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, params, use_tqdm=use_tqdm)
