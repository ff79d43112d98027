"""Requests and their sampling parameters: what the scheduler and the runners act on."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvserve.kv.connector import KVTransferParams
    from kvserve.structured.spec import GuidedSpec

_INT32_MAX = (1 << 31) - 1
# Bounds on what a request may ask for, so that its cost stays bounded before any work starts
# (stop strings are matched against the text after every token).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 128
MAX_LOGPROBS = 20  # top-n alternatives per token, sampled and prompt alike (vLLM's default max_logprobs)
LOGIT_BIAS_RANGE = 100.0  # OpenAI's bound on a logit_bias value


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop; names and defaults follow vLLM."""

    max_tokens: int | None = 16  # None: up to the context window
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per sampled token (0: only the sampled token's)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided: "GuidedSpec | None" = None  # structured output: what the text must match
    # vLLM's extras: logprobs of the prompt's tokens (top-n each), and per-token logit processing
    prompt_logprobs: int | None = None
    min_tokens: int = 0  # EOS and the stop token ids cannot be sampled before this many tokens
    logit_bias: dict[int, float] | None = None  # added to the logits of these token ids
    allowed_token_ids: list[int] | None = None  # only these can be sampled
    bad_words: list[str] | None = None  # never produced (their token ids: text.tokenizer.bad_words_token_ids)
    bad_words_token_ids: list[list[int]] | None = None  # token sequences the output never ends with
    kv_transfer: "KVTransferParams | None" = None  # disaggregated prefill: this request's side of a KV handoff

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check()
        self._check_logit_processing()
        self._check_kv_transfer()

    def _check(self) -> None:
        def bad(param: str, why: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"{param} {why}", param=param)

        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= _INT32_MAX:
            raise bad("top_k", f"must be -1 (off) or in [1, {_INT32_MAX}], got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise bad("repetition_penalty", f"must be in (0, 100], got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise bad("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if self.seed is not None and not -(1 << 63) <= self.seed < (1 << 64):
            raise bad("seed", "must fit in 64 bits")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise bad("stop", f"must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if any(not isinstance(t, int) or not 0 <= t <= _INT32_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be token ids (non-negative 32-bit integers)")

    def _check_kv_transfer(self) -> None:
        t = self.kv_transfer
        if t is None:
            return
        if t.receives and (self.guided is not None or self.prompt_logprobs is not None):
            raise InvalidArgumentError("kv_transfer_params with first_token_ids cannot be combined with structured "
                                       "output or prompt_logprobs", param="kv_transfer_params")

    def _check_logit_processing(self) -> None:
        def bad(param: str, why: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"{param} {why}", param=param)

        def is_token_id(t: Any) -> bool:
            return isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _INT32_MAX

        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be at least 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logit_bias:
            bias = {}
            for t, v in self.logit_bias.items():
                try:  # OpenAI's keys are token ids written as strings
                    t = int(t)
                except (TypeError, ValueError):
                    raise bad("logit_bias", f"keys must be token ids, got {t!r}") from None
                if not is_token_id(t):
                    raise bad("logit_bias", f"keys must be token ids (non-negative 32-bit integers), got {t}")
                if not isinstance(v, (int, float)) or not -LOGIT_BIAS_RANGE <= v <= LOGIT_BIAS_RANGE:
                    raise bad("logit_bias", f"values must be in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], "
                                            f"got {v!r} for token {t}")
                bias[t] = float(v)
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", "must not be empty")
            if not all(is_token_id(t) for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "must be token ids (non-negative 32-bit integers)")
        if self.bad_words:
            check_bad_words(self.bad_words)
        if self.bad_words_token_ids is not None:
            seqs = [list(s) for s in self.bad_words_token_ids]
            if any(not s or not all(is_token_id(t) for t in s) for s in seqs):
                raise bad("bad_words", "each bad word must be a non-empty sequence of token ids")
            self.bad_words_token_ids = seqs

    def check_vocab(self, vocab_size: int) -> None:
        """Raise InvalidArgumentError for a token id the model cannot produce (engine-side check)."""
        for param, ids in (("stop_token_ids", self.stop_token_ids or ()),
                           ("logit_bias", (self.logit_bias or {}).keys()),
                           ("allowed_token_ids", self.allowed_token_ids or ()),
                           ("bad_words", [t for s in self.bad_words_token_ids or () for t in s])):
            # beyond the vocabulary is not only pointless: a grammar's matcher rejects such ids,
            # and an index past the logits' width would raise in the sampler
            if any(t >= vocab_size for t in ids):
                raise InvalidArgumentError(f"{param} must hold token ids in [0, {vocab_size})", param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def has_logit_processing(self) -> bool:
        """Whether logits need more than the penalties: a bias, an allow-list, bad words, min_tokens."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids or self.min_tokens)


def check_bad_words(words: Any) -> None:
    if not isinstance(words, list) or len(words) > MAX_BAD_WORDS:
        raise InvalidArgumentError(f"bad_words must be a list of at most {MAX_BAD_WORDS} words", param="bad_words")
    if any(not isinstance(w, str) or not w.strip() or len(w) > MAX_STOP_STRING_CHARS for w in words):
        raise InvalidArgumentError(f"bad_words must be non-blank strings of at most {MAX_STOP_STRING_CHARS} "
                                   "characters", param="bad_words")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # the client went away or asked to cancel


@dataclass
class TokenLogprobs:
    """Log-probability of the sampled token, and the top-n alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # the token's rank in its distribution (1: most likely); prompt logprobs only


@dataclass
class SpecState:
    """A request's speculative decoding: its pending draft and how well its drafts have fared."""

    draft_token_ids: list[int] = field(default_factory=list)  # proposed after the last step, verified next
    acceptance: float | None = None  # moving average of accepted / tried draft positions; None: unmeasured
    num_verifies: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per verify step (accepted drafts plus the target's own token)."""
        return 1.0 + self.num_accepted_tokens / self.num_verifies if self.num_verifies else None


@dataclass(eq=False)
class Request:
    """One sequence as the scheduler sees it: token ids and how far the KV cache covers them."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_total_tokens: int = 1 << 30  # context window: prompt + output may not pass it
    arrival_time: float = field(default_factory=time.monotonic)

    # prompt then outputs; its length minus num_computed_tokens is what still needs a forward
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first schedule
    # decided at first schedule: the uncached prompt is long, so its prefill is metered by the step
    # time budget to the end (its last chunk is not "short" just because little is left)
    long_prefill: bool | None = None
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # with params.prompt_logprobs: those of prompt tokens 1, 2, ... (token 0 has none), as computed
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    first_token_time: float | None = None
    scheduled_time: float | None = None  # when it was first admitted to run (clock of the engine)
    restored_blocks: dict[str, int] = field(default_factory=dict)  # tier -> blocks restored at that admission
    spec: SpecState = field(default_factory=SpecState)
    # structured output: the request's grammar state (a kvserve.structured.GrammarMatcher, opaque to
    # the scheduler), advanced by the runner as tokens are sampled
    grammar: Any = None
    lora: Any = None  # its LoRA adapter (a kvserve.lora.registry.LoRARef); None: the base model
    cache_seed: bytes = b""  # its prefix-cache namespace (an adapter's); b"": the base model's

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked for and not all computed yet (the prompt must then run through
        the model: no prefix cache hit can stand in for it)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def append_token(self, token_id: int) -> None:
        """Add a sampled token and decide whether that ends the request."""
        self.token_ids.append(token_id)
        p = self.params
        if not p.ignore_eos and token_id in self.eos_token_ids:
            self.finish(FinishReason.STOP)
        elif token_id in p.stop_token_ids:
            self.finish(FinishReason.STOP, stop_reason=token_id)
        elif (p.max_tokens is not None and self.num_output_tokens >= p.max_tokens) or (
            self.num_tokens >= self.max_total_tokens
        ):
            self.finish(FinishReason.LENGTH)
        elif self.grammar is not None and self.grammar.is_terminated():
            self.finish(FinishReason.STOP)  # the grammar is complete and took its stop token

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
