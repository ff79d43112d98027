"""The simulated runner: executes a Batch by advancing a virtual clock by its roofline cost.

It satisfies the same Runner protocol as the torch runner, so the engine, scheduler, KV
manager and radix cache driving it are the real ones. Sampled tokens are synthetic (the
simulator's requests run to their ``max_tokens``); KV offload payloads are placeholders
that only carry their size.
"""

from __future__ import annotations

import zlib

from kvserve.engine.batch import Batch, StepOutput
from kvserve.sim.cost_model import ChunkShape, Roofline
from kvserve.sim.profiles import EngineProfile


class VirtualClock:
    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SizedPayload:
    """Stands in for a block's KV bytes in the offload tiers: only its length matters."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes


class SimRunner:

    def __init__(self, roofline: Roofline, profile: EngineProfile, clock: VirtualClock, *,
                 num_kv_blocks: int, block_size: int, max_model_len: int):
        self.roofline = roofline
        self.profile = profile
        self.clock = clock
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.block_bytes = roofline.model.kv_layout(roofline.kv, block_size).block_bytes
        self.kv_bytes_per_token = roofline.model.kv_layout(roofline.kv, block_size).bytes_per_token
        self.kv_fingerprint = b"sim:" + roofline.model.name.encode()
        self.busy_s = 0.0  # time spent in steps (the rest of the virtual time was idle)

    def step_seconds(self, batch: Batch) -> float:
        decodes = [c for c in batch.chunks if c.is_decode]
        prefills = [c for c in batch.chunks if not c.is_decode]
        p = self.profile
        # speculation: each decode verifies k drafts in the same forward (k more query rows)
        k = p.spec_tokens
        decode_shapes = [ChunkShape(c.start, 1 + k, True, decode=True) for c in decodes]
        prefill_shapes = [ChunkShape(c.start, c.num_tokens, c.sample) for c in prefills]
        rf = self.roofline
        if p.disaggregated:
            # two pools working at once; the prefill pool ships each finished prompt's KV over the link
            t_pre = rf.step(prefill_shapes).seconds if prefills else 0.0
            t_pre += rf.transfer_seconds(sum(c.num_tokens for c in prefills) * rf.model.kv_bytes_per_token(rf.kv)) \
                if prefills else 0.0
            t_dec = rf.step(decode_shapes).seconds if decodes else 0.0
            seconds = max(t_pre, t_dec / p.tokens_per_decode_step)
        else:
            seconds = rf.step(decode_shapes + prefill_shapes).seconds
            if decodes and not prefills:
                # the scheduler sees one token per decode step; a step that emits more tokens
                # is charged as that many cheaper steps
                seconds /= p.tokens_per_decode_step
        # loads (host -> device) must land before the step reads them: on the critical path. Saves
        # (device -> host) run on a copy stream beside the step, as engines do them: only the part
        # longer than the step itself costs time.
        # (blocks a prefill replica sent straight into this replica's memory paid their way on the KV link)
        loads = sum(self.block_bytes for t in batch.kv_transfers
                    if t.kind == "load" and not getattr(t.payload, "direct", False))
        saves = sum(self.block_bytes for t in batch.kv_transfers if t.kind == "save")
        seconds = max(seconds, rf.transfer_seconds(saves)) if saves else seconds
        return seconds + (rf.transfer_seconds(loads) if loads else 0.0)

    def execute(self, batch: Batch) -> StepOutput:
        out = StepOutput()
        for t in batch.kv_transfers:
            if t.kind == "save":
                out.saved_kv[t.key] = SizedPayload(self.block_bytes)  # type: ignore[assignment]
        seconds = self.step_seconds(batch)
        self.clock.advance(seconds)
        self.busy_s += seconds
        vocab = self.roofline.model.vocab
        for c in batch.chunks:
            if c.sample:  # a token of its own per request and position, so outputs share no cache blocks
                rid = c.request.request_id
                out.token_ids[rid] = [(zlib.crc32(rid.encode()) + 7919 * c.request.num_tokens) % vocab]
        return out
