"""The Runner protocol: the only thing the engine loop needs from whatever executes a batch."""

from __future__ import annotations

from typing import Protocol

from kvserve.engine.batch import Batch, StepOutput


class Runner(Protocol):
    num_kv_blocks: int
    block_bytes: int  # bytes of one KV block (all layers), what an offload tier stores per block
    kv_fingerprint: bytes  # identifies model + KV layout; keys stored KV
    block_size: int
    max_model_len: int

    def execute(self, batch: Batch) -> StepOutput:
        """Run one step: write the chunks' KV, and sample for the chunks that end a sequence."""
        ...
