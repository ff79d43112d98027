"""What crosses between the engine core and its clients: commands in, step messages out.

Plain picklable dataclasses over token ids, so any transport (a multiprocessing queue and
pipe, a Ray actor call, a direct call in-process) can carry them unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.live_state import EngineState
from kvserve.engine.request import SamplingParams, TokenLogprobs
from kvserve.errors import InvalidArgumentError, KVServeError, MissingPackageError, ServiceUnavailableError
from kvserve.kv.manager import PrefixCacheStats
from kvserve.spec.policy import SpecStats

# --------------------------------------------------------------------------- commands


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    trace: bool = False  # the client traces it: the first delta carries the request's timeline
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class LoRACommand:
    """Load (``action`` "load", from ``path``) or unload an adapter; a ``CommandReply`` in the next message answers."""

    command_id: str
    action: str
    name: str
    path: str | None = None


@dataclass
class ReportState:
    """Ask for an ``EngineState`` (requests, blocks, prefix tree) in the next step message."""


@dataclass
class Shutdown:
    pass


# Sleep, wake and weight updates (kvserve.engine.model_ops) run between steps once the requests in
# flight are done; requests added meanwhile wait behind them. Each is answered by a CommandReply.
@dataclass
class Sleep:
    command_id: str
    level: int  # 1: free the KV cache; 2: the weights too (reloaded from disk on wake)


@dataclass
class WakeUp:
    command_id: str


@dataclass
class UpdateWeights:
    command_id: str
    model_path: str
    load_format: str = "auto"
    abort_all_requests: bool = False  # True: requests in flight end now with an error (else they finish first)


ModelCommand = Sleep | WakeUp | UpdateWeights
EngineCommand = ModelCommand | LoRACommand  # the commands a CommandReply answers


# --------------------------------------------------------------------------- answers


@dataclass
class EngineReady:
    """The engine's first message: what a client must know to validate requests."""

    model_name: str
    max_model_len: int
    vocab_size: int | None
    num_kv_blocks: int
    block_size: int
    resident_memory_bytes: int | None = None
    kv_bytes_per_token: int = 0  # of the KV cache's dtype (--kv-cache-dtype)
    prefix_caching: bool = False
    cache_root_key: bytes = b""  # the seed of the prefix cache's chain hashes (kv/radix_cache.py)
    kv_transfer_address: str = ""  # HOST:PORT where prefill replicas send this one KV (kv/tcp_connector.py)
    lora_adapters: list[str] | None = None  # the adapters loaded (None: LoRA is off)


@dataclass
class EngineFailed:
    """The engine could not start, or a step raised: the engine is gone after sending this."""

    message: str
    user_error: bool  # a KVServeError (e.g. the model could not be loaded) rather than a bug


@dataclass
class RequestTimeline:
    """When a request reached each stage in the engine (its clock: time.monotonic), for a trace."""

    queued: float  # added to the engine (after its grammar compiled, if it has one)
    scheduled: float | None  # first admitted to run
    first_token: float | None
    restored_blocks: dict[str, int] = field(default_factory=dict)  # tier -> blocks restored when admitted


@dataclass
class RequestDelta:
    """What one step did to one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    spec: tuple[int, int, int] = (0, 0, 0)  # verifies, draft tokens, accepted tokens (so far)
    prompt_logprobs: list[TokenLogprobs] | None = None  # once, in the request's first delta, if asked for
    timeline: RequestTimeline | None = None  # once, in the first delta of a traced request


@dataclass
class RequestRejected:
    """Adding this request raised a user error."""

    request_id: str
    message: str
    param: str | None
    code: str | None

    def error(self) -> KVServeError:
        """The error the request's caller gets: a missing package (501), the server asleep or the request
        aborted by a weight update (503), else a bad argument (400)."""
        if self.code == MissingPackageError.CODE:
            return MissingPackageError(self.message, param=self.param)
        if self.code in ServiceUnavailableError.CODES:
            return ServiceUnavailableError(self.message, code=self.code)
        return InvalidArgumentError(self.message, param=self.param, code=self.code)


@dataclass
class CommandReply:
    """The answer to an ``EngineCommand`` (same ``command_id``): ``error`` (a KVServeError, pickled whole,
    None when it worked) and what it did (``data``: a LoRA command's has "adapters", those loaded after it)."""

    command_id: str
    error: Exception | None = None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineStatsSnapshot:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_bytes_per_token: int = 0  # K and V of one token, all layers, as the KV cache stores them
    num_preemptions: int = 0
    prompt_tokens: int = 0  # prefill tokens computed (recomputation after preemption included)
    generation_tokens: int = 0
    kv_blocks_cached: int = 0  # blocks held by the prefix cache
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    spec: SpecStats = field(default_factory=SpecStats)
    grammar: Any = None  # kvserve.structured.CacheStats once a grammar was asked for
    resident_memory_bytes: int | None = None  # the engine process's RSS (Linux only)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass
class StepMessage:
    deltas: list[RequestDelta]
    rejected: list[RequestRejected]
    stats: EngineStatsSnapshot
    step_end: float  # time.monotonic() where the engine runs (CLOCK_MONOTONIC is system-wide)
    # chain hashes of the blocks the prefix cache stored and removed since the last message
    kv_stored: list[bytes] = field(default_factory=list)
    kv_removed: list[bytes] = field(default_factory=list)
    state: EngineState | None = None  # after a ReportState: what the engine is doing now
    replies: list[CommandReply] = field(default_factory=list)  # the commands done since the last message
