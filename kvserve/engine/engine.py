"""The engine loop: schedule → execute → update, one step at a time.

The engine owns the scheduler and the KV bookkeeping and calls whatever Runner it was
given; it works on token ids only (text lives in ``kvserve.text``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.config import SchedulerConfig, SpeculationConfig
from kvserve.engine.batch import Batch, Runner
from kvserve.engine.request import FinishReason, Request, SamplingParams
from kvserve.engine.scheduler import Scheduler
from kvserve.errors import InvalidArgumentError
from kvserve.kv.manager import KVManager


@dataclass
class StepRecord:
    """What one step did and how long it took; benchmarks and the simulator's calibration read these."""

    num_tokens: int
    num_decodes: int
    num_seqs: int
    seconds: float


@dataclass
class EngineStats:
    steps: list[StepRecord] = field(default_factory=list)
    keep_steps: bool = False
    prompt_tokens: int = 0
    generation_tokens: int = 0


def check_prompt(prompt_token_ids: list[int], max_model_len: int, vocab_size: int | None) -> None:
    """Raise InvalidArgumentError unless the prompt is non-empty, leaves room for an answer, and
    holds only known token ids. The engine and the server's API process both call it."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidArgumentError("the prompt is empty", param="prompt")
    if n >= max_model_len:
        raise InvalidArgumentError(
            f"the prompt has {n} tokens; this model's context window is {max_model_len} tokens "
            "and at least one must be left for the answer",
            param="prompt",
            code="context_length_exceeded",
        )
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise InvalidArgumentError(f"prompt token ids must be in [0, {vocab_size})", param="prompt")


class Engine:
    def __init__(self, runner: Runner, scheduler_config: SchedulerConfig, vocab_size: int | None = None,
                 eos_token_ids: tuple[int, ...] = (), kv: KVManager | None = None,
                 clock: Callable[[], float] = time.monotonic, grammars: Callable[[], Any] | None = None,
                 speculation: SpeculationConfig | None = None, max_loras: int = 0):
        """``speculation``: the drafts the runner's proposer makes are verified as it says (None: off);
        ``max_loras``: most distinct LoRA adapters in one step (0: no adapters)."""
        self.runner = runner
        states = getattr(runner, "num_state_slots", 0)
        self.kv = kv or KVManager(runner.num_kv_blocks, runner.block_size, enable_prefix_caching=not states,
                                  state_slots=states)
        # the wall clock here; the simulator's virtual clock, which its runner advances, there
        self.clock = clock
        if self.kv.cache is not None:
            self.kv.cache.clock = clock  # the prefix tree's "last used" on the same clock
        self.scheduler = Scheduler(scheduler_config, self.kv, clock, speculation, max_loras)
        self.max_model_len = runner.max_model_len
        if not scheduler_config.chunked_prefill and scheduler_config.max_num_batched_tokens < self.max_model_len:
            # a prompt (or a preempted request's recompute) longer than the budget would never run
            raise InvalidArgumentError(f"without chunked prefill the step budget ({scheduler_config.max_num_batched_tokens} "
                                       f"tokens) must hold the context window ({self.max_model_len} tokens)",
                                       param="max_num_batched_tokens")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.stats = EngineStats()
        self._grammar_factory = grammars
        self._grammars: Any = None

    @property
    def grammars(self) -> Any:
        """The structured-output compile cache (a kvserve.structured.GrammarCache), built on first use."""
        if self._grammars is None:
            if self._grammar_factory is None:
                raise InvalidArgumentError("structured output needs the model's tokenizer, and this engine has none",
                                           param="guided")
            self._grammars = self._grammar_factory()
        return self._grammars

    def grammar_stats(self) -> Any:
        """The compile cache's counters (None until structured output was first asked for)."""
        return self._grammars.stats() if self._grammars is not None else None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    grammar: Any = None, lora: Any = None, *, output_token_ids: list[int] | None = None,
                    queue: bool = True) -> Request:
        """Validate and queue a request; raises InvalidArgumentError for what the user must fix.
        ``grammar``: the compiled ``params.guided``, if the caller compiled it (off this thread);
        otherwise it is compiled here. ``lora``: the request's adapter (a ``LoRARef``), None for the base
        model. ``output_token_ids``: tokens another replica sampled already (disaggregated prefill), appended
        as outputs; ``queue`` False leaves queueing to the caller."""
        check_prompt(prompt_token_ids, self.max_model_len, self.vocab_size)
        if self.vocab_size is not None:
            params.check_vocab(self.vocab_size)
        req = Request(request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids,
                      max_total_tokens=self.max_model_len, arrival_time=self.clock())
        if lora is not None:  # its blocks in a prefix-cache namespace of its own
            req.lora, req.cache_seed = lora, lora.cache_seed(self.kv.cache_root_key)
        if params.guided is not None:
            from kvserve.structured import new_matcher

            compiled = grammar if grammar is not None else self.grammars.get_or_compile(params.guided)
            # the grammar ends on EOS or a stop token (with ignore_eos too: a complete match is the end)
            req.grammar = new_matcher(compiled, stop_token_ids=[*self.eos_token_ids, *(params.stop_token_ids or ())],
                                      utf8_guard=getattr(self.grammars, "utf8_guard", None))
        for token in output_token_ids or ():
            if self.vocab_size is not None and not 0 <= token < self.vocab_size:
                raise InvalidArgumentError(f"first_token_ids must be in [0, {self.vocab_size})",
                                           param="kv_transfer_params")
            if not req.is_finished:
                req.append_token(token)
        if queue and not req.is_finished:
            self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> Request | None:
        return self.scheduler.finish(request_id, FinishReason.ABORT)

    def finish(self, request_id: str, reason: FinishReason, stop_reason: int | str | None = None) -> Request | None:
        return self.scheduler.finish(request_id, reason, stop_reason)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """Run one step; returns the requests that got a token (finished ones included)."""
        batch: Batch = self.scheduler.schedule()
        if batch.empty:
            return []
        t0 = self.clock()
        output = self.runner.execute(batch)
        elapsed = self.clock() - t0
        if batch.kv_transfers:
            self.kv.complete_saves(batch.kv_transfers, output.saved_kv)
        if not batch.chunks:  # only tier copies ran
            return []
        self.scheduler.observe_step(batch, elapsed)
        changed = self.scheduler.update(batch, output)
        now = self.clock()
        for req in changed:
            if req.first_token_time is None:
                req.first_token_time = now
        self.stats.generation_tokens = self.scheduler.stats.num_generated_tokens
        self.stats.prompt_tokens += batch.num_prefill_tokens
        if self.stats.keep_steps:
            self.stats.steps.append(StepRecord(batch.num_tokens, batch.num_decode_tokens, len(batch.chunks), elapsed))
        return changed
