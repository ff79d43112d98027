"""Building an engine from a config: the runner (on the device and dtype ``kvserve.device``
resolves), the proposer, the KV manager, and the engine core around them.

Everything that turns a ``KVServeConfig`` into running objects is here, above both the engine
(which knows no torch) and its clients (the in-process ``LLM``, the server's engine process).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch

from kvserve.config import KVServeConfig
from kvserve.cpu_bind import bind, format_cpu_list, resolve_cpu_bind
from kvserve.device import amx_gemm_available, resolve_deterministic, resolve_device, resolve_dtype
from kvserve.model.quant_linear import runs_quantized
from kvserve.engine.core import EngineCore
from kvserve.engine.engine import Engine
from kvserve.errors import InvalidArgumentError, MissingPackageError, ModelLoadError
from kvserve.engine.handoff import Handoff
from kvserve.kv.connector import KVConnector, SharedTierConnector
from kvserve.kv.manager import KVManager
from kvserve.kv.tcp_connector import TCPConnector
from kvserve.lora.registry import parse_lora_modules
from kvserve.kv.disk_tier import DiskTier
from kvserve.kv.tiers import HostTier, Tier
from kvserve.model.config import ModelConfig
from kvserve.runner.torch_runner import TorchRunner
from kvserve.runner.weight_update import ModelSource
from kvserve.spec.draft import DraftProposer
from kvserve.spec.ngram import NgramProposer
from kvserve.spec.proposer import Proposer

log = logging.getLogger(__name__)

Weights = dict[str, torch.Tensor]


def build_engine(config: KVServeConfig, model_cfg: ModelConfig, weights: Weights, eos_token_ids: list[int],
                 draft_weights: tuple[ModelConfig, Weights] | None = None, hf_tokenizer: Any = None,
                 source: ModelSource | None = None) -> Engine:
    """The torch runner and the engine loop around it, from a config and loaded weights.
    ``draft_weights`` stands in for loading ``--speculative-model`` (tests pass tiny models);
    ``hf_tokenizer`` (a transformers tokenizer) enables structured output; ``source``: where ``weights``
    were read (a level-2 sleep reloads them from there)."""
    m = config.model
    cpus = resolve_cpu_bind(m.cpu_bind)
    if cpus is not None:  # before the first parallel region: the OpenMP team inherits the mask
        bind(cpus)
        log.info("--cpu-bind: the engine's threads on CPUs %s", format_cpu_list(cpus))
    if m.num_threads or cpus:
        torch.set_num_threads(m.num_threads or len(cpus or ()))
    if model_cfg.has_recurrent_state:
        refuse_for_recurrent_state(config)
    device = resolve_device(m.device)
    dtype = resolve_dtype(m.dtype, device, quantized=runs_quantized(m.quantization, weights))
    deterministic = resolve_deterministic(m.deterministic, device)
    if deterministic and amx_gemm_available():
        log.info("--deterministic: the bf16 AMX paths are off (linears and prefill attention run as decode's do)")
    runner = TorchRunner(model_cfg, weights, config.cache, dtype=dtype, device=device, max_model_len=m.max_model_len,
                         seed=m.seed, quantization=m.quantization, max_num_seqs=config.scheduler.max_num_seqs,
                         max_num_batched_tokens=config.scheduler.max_num_batched_tokens, lora=config.lora,
                         deterministic=deterministic)
    if runner.lora is not None:
        for name, path in parse_lora_modules(config.lora.lora_modules).items():
            runner.lora.load(name, path)
    runner.proposer = build_proposer(config, model_cfg, runner, draft_weights)
    runner.source = source

    def grammars():  # built on first use: describing the vocabulary to xgrammar takes ~0.5 s
        if importlib.util.find_spec("xgrammar") is None:  # each request that needs it is refused (501)
            raise MissingPackageError.of("structured output", "xgrammar", param="response_format")
        from kvserve.structured import GrammarCache

        s = config.structured
        return GrammarCache.from_tokenizer(hf_tokenizer, model_cfg.vocab_size, list(eos_token_ids),
                                           max_size=s.grammar_cache_size,
                                           compile_timeout_s=s.grammar_compile_timeout_s or None)

    return Engine(runner, config.scheduler, max_loras=config.lora.max_loras if runner.lora else 0,
                  vocab_size=model_cfg.vocab_size, eos_token_ids=tuple(eos_token_ids),
                  kv=build_kv_manager(config, runner.num_kv_blocks, runner.block_size, runner.block_bytes,
                                      runner.kv_fingerprint, sliding_window=model_cfg.kv_window(),
                                      state_slots=runner.num_state_slots),
                  grammars=grammars if hf_tokenizer is not None else None,
                  speculation=config.speculation if runner.proposer is not None else None)


def refuse_for_recurrent_state(config: KVServeConfig) -> None:
    """What a model with recurrent layers (Mamba, gated delta nets) cannot run, in one line: each needs KV for a prefix
    without the sequence's state (offload tiers and KV hand-over restore a prefix; speculative steps would have to roll
    the state back)."""
    cache, why = config.cache, ""
    if config.speculation.speculative_method is not None:
        why = "speculative decoding (its rejected tokens would stay in the recurrent state)"
    elif cache.kv_offload_memory_gb or cache.kv_offload_dir or cache.kv_offload_url:
        why = "KV offload tiers (they restore prefixes, and a recurrent state is the whole sequence's)"
    elif cache.role != "both":
        why = f"--role {cache.role} (KV hand-over carries no recurrent state)"
    if why:
        raise InvalidArgumentError(f"this model's recurrent layers keep a state per sequence: {why} is not supported")


def build_proposer(config: KVServeConfig, model_cfg: ModelConfig, runner: TorchRunner,
                   draft_weights: tuple[ModelConfig, Weights] | None) -> Proposer | None:
    spec = config.speculation
    if spec.speculative_method == "ngram":
        return NgramProposer(spec.ngram_min, spec.ngram_max)
    if spec.speculative_method != "draft":
        return None
    if draft_weights is None:
        from kvserve.model.loader import load_model, resolve_model_path

        # --load-format dummy applies to the draft too, with another seed: a draft of the target's shape
        # would otherwise be the target itself, every token accepted
        m = config.model
        loaded = load_model(resolve_model_path(spec.speculative_model), load_format=m.load_format, seed=m.seed + 1)
        draft_weights = (loaded.config, loaded.weights)
    draft_cfg, weights = draft_weights
    if draft_cfg.vocab_size != model_cfg.vocab_size:
        raise ModelLoadError(f"the draft model's vocabulary has {draft_cfg.vocab_size} tokens and the target's "
                             f"{model_cfg.vocab_size}: a draft model must share the target's tokenizer")
    return DraftProposer(draft_cfg, weights, dtype=runner.dtype, device=runner.device,
                         num_blocks=runner.num_kv_blocks, block_size=runner.block_size, seed=config.model.seed,
                         attention_backend=config.cache.attention_backend, kv_cache_dtype=config.cache.kv_cache_dtype)


def build_kv_manager(config: KVServeConfig, num_blocks: int, block_size: int, block_bytes: int,
                     fingerprint: bytes, sliding_window: int | None = None, state_slots: int = 0) -> KVManager:
    """The KV manager with the prefix cache and the offload tiers the config asks for; ``sliding_window``:
    every layer's window (``ModelConfig.kv_window``), behind which sequences let go of their blocks;
    ``state_slots``: how many sequences' recurrent states the model keeps (then no prefix cache)."""
    cache = config.cache
    prefix_caching = cache.enable_prefix_caching and not state_slots
    if state_slots and cache.enable_prefix_caching:
        log.info("prefix caching off: this model's recurrent layers keep a state per sequence, which no cached prefix "
                 "holds")
    tiers: list[Tier] = []
    if cache.kv_offload_memory_gb:
        tiers.append(HostTier(int(cache.kv_offload_memory_gb * (1 << 30))))
    if cache.kv_offload_dir:
        tiers.append(DiskTier(cache.kv_offload_dir, int(cache.kv_offload_disk_gb * (1 << 30)), fingerprint,
                              shared=cache.kv_offload_dir_shared))
    if cache.kv_offload_url:
        from kvserve.kv.redis_tier import RedisTier

        tiers.append(RedisTier(cache.kv_offload_url, fingerprint))
    if sliding_window is not None:
        log.info("sliding window of %d tokens on every layer: each sequence keeps only the KV blocks of its "
                 "window (%d blocks of %d tokens, and a step's chunk)", sliding_window,
                 -(-sliding_window // block_size) + 1, block_size)
    return KVManager(num_blocks, block_size, enable_prefix_caching=prefix_caching, tiers=tiers,
                     fingerprint=fingerprint, block_bytes=block_bytes, sliding_window=sliding_window,
                     state_slots=state_slots)


def build_handoff(config: KVServeConfig, engine: Engine) -> Handoff | None:
    """A prefill or decode replica's side of disaggregated prefill (None for ``--role both``); a decode
    replica's connector listens, and what it receives joins its tiers."""
    cache = config.cache
    if cache.role == "both":
        return None
    if cache.kv_connector == "shared-tier":
        connector: KVConnector = SharedTierConnector([t for t in engine.kv.tiers.tiers if getattr(t, "write_through", False)])
    else:
        port = cache.kv_transfer_port if cache.role == "decode" else None
        connector = TCPConnector(engine.runner.kv_fingerprint, host=cache.kv_transfer_host, port=port,
                                 api_key=config.server.api_key)
        if connector.address:
            log.info("receiving KV from prefill replicas on %s", connector.address)
    engine.kv.tiers.tiers.extend(connector.tiers())
    return Handoff(engine.kv, connector, cache.kv_transfer_timeout_s)


def build_engine_core(config: KVServeConfig) -> EngineCore:
    """Load the configured model and build its engine core (the engine process's start-up)."""
    from kvserve.model.loader import load_model, resolve_model_path
    from kvserve.text.tokenizer import Tokenizer

    path = resolve_model_path(config.model.model)
    log.info("loading model %s ...", path)
    m = config.model
    loaded = load_model(path, keep_quantized=m.quantization != "none", load_format=m.load_format, seed=m.seed)
    eos = Tokenizer(loaded.tokenizer, loaded.config).eos_token_ids
    engine = build_engine(config, loaded.config, loaded.hand_over(), eos, hf_tokenizer=loaded.tokenizer,
                          source=ModelSource(str(path), m.load_format, m.seed))
    return EngineCore(engine, loaded.name, build_handoff(config, engine))
