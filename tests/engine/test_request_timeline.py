"""The engine's side of tracing: a traced request's first output carries its timeline (queued, scheduled,
first token, tier restores), once; an untraced request's never does."""

from __future__ import annotations

import itertools

from kvserve import SamplingParams
from kvserve.config import SchedulerConfig
from kvserve.engine.batch import Batch, StepOutput
from kvserve.engine.core import EngineCore
from kvserve.engine.engine import Engine
from kvserve.engine.messages import AddRequest
from kvserve.kv.manager import KVManager


class FakeRunner:
    """Token 7 for every sampling chunk."""

    block_size = 4
    block_bytes = 64
    kv_fingerprint = b"fake"
    num_kv_blocks = 64
    max_model_len = 256

    def execute(self, batch: Batch) -> StepOutput:
        return StepOutput(token_ids={c.request.request_id: [7] for c in batch.chunks if c.sample})


def test_only_a_traced_requests_first_delta_carries_its_timeline():
    ticks = itertools.count()
    clock = lambda: float(next(ticks))  # noqa: E731 - every reading is later than the one before
    kv = KVManager(64, 4)
    core = EngineCore(Engine(FakeRunner(), SchedulerConfig(max_num_batched_tokens=64, prefill_step_factor=0.0),
                             kv=kv, clock=clock), "fake")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    core.add(AddRequest("traced", list(range(1, 20)), params, trace=True))
    core.add(AddRequest("plain", list(range(30, 50)), params))
    deltas = []
    while core.has_work:
        msg = core.step()
        if msg is not None:
            deltas += msg.deltas
    traced = [d for d in deltas if d.request_id == "traced"]
    assert len(traced) == 3 and all(d.timeline is None for d in traced[1:])
    tl = traced[0].timeline
    assert tl is not None and tl.queued < tl.scheduled < tl.first_token and tl.restored_blocks == {}
    assert all(d.timeline is None for d in deltas if d.request_id == "plain")
