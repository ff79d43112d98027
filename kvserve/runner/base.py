"""The Runner protocol: the only thing the engine loop needs from whatever executes a batch."""

from __future__ import annotations

from typing import Protocol

from kvserve.engine.batch import Batch, StepOutput


class Runner(Protocol):
    num_kv_blocks: int
    block_size: int
    max_model_len: int

    def execute(self, batch: Batch) -> StepOutput:
        """Run one step: write the chunks' KV, and sample for the chunks that end a sequence."""
        ...
