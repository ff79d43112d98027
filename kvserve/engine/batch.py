"""What crosses between the scheduler and a runner: the batch of one step, its result, and the
``Runner`` protocol (the only thing the engine loop needs from whatever executes a batch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvserve.engine.request import Request, TokenLogprobs
from kvserve.kv.manager import KVTransfer


@dataclass
class ScheduledChunk:
    """``num_tokens`` tokens of ``request`` starting at position ``start`` go through the model.

    The KV of positions < start is already in the cache, or is written by another chunk of the
    same step (a shared prefix: every layer writes all rows' K/V before any row reads the cache).
    ``sample`` is true when the chunk reaches the end of the request's tokens, so a next token is
    drawn from its last logits.
    A verify chunk is a decode followed by drafted tokens: all of them are scored at once.
    """

    request: Request
    start: int
    num_tokens: int
    block_table: list[int]
    draft_token_ids: list[int] = field(default_factory=list)  # verified in this step
    propose_k: int = 0  # tokens to draft after this step, for the next one
    state_slot: int = -1  # the sequence's recurrent state (KVManager.state_slot); -1: the model has none

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def sample(self) -> bool:
        return self.end - len(self.draft_token_ids) == self.request.num_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.start > 0

    @property
    def is_verify(self) -> bool:
        return bool(self.draft_token_ids)

    @property
    def input_token_ids(self) -> list[int]:
        if self.draft_token_ids:
            return [self.request.token_ids[self.start]] + self.draft_token_ids
        return self.request.token_ids[self.start : self.end]


@dataclass
class Batch:
    """One step's work, decodes first then prefill chunks, within the token budget."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # block copies to and from the offload tiers, done in order before the forward pass
    kv_transfers: list[KVTransfer] = field(default_factory=list)
    # requests gone since the last step (finished, aborted): the runner drops what it keeps for them
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for c in self.chunks if c.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if not c.is_decode and not c.is_verify)

    @property
    def empty(self) -> bool:
        return not self.chunks and not self.kv_transfers and not self.finished_request_ids


@dataclass
class StepOutput:
    """The runner's answer, per sampling request: its new tokens (one, or with speculation the
    accepted drafts and one more), their logprobs if asked for, and the draft for the next step."""

    token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    saved_kv: dict[bytes, bytes] = field(default_factory=dict)  # payloads of the batch's "save" transfers
    # requests asking for prompt logprobs: those of the prompt tokens this step's chunk predicted
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


class Runner(Protocol):
    """Executes batches: the torch runner (``kvserve.runner``) or the simulator's (``kvserve.sim``)."""

    num_kv_blocks: int
    block_bytes: int  # bytes of one KV block (all layers), what an offload tier stores per block
    kv_fingerprint: bytes  # identifies model + KV layout; keys stored KV
    block_size: int
    max_model_len: int

    def execute(self, batch: Batch) -> StepOutput:
        """Run one step: write the chunks' KV, and sample for the chunks that end a sequence."""
        ...
