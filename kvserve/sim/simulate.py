"""Run a workload through the real engine on a virtual clock: the simulator's main loop.

``build_sim_engine`` wires the engine's own Scheduler, KVManager and RadixCache to a
SimRunner; ``simulate`` replays a :class:`~kvserve.bench.datasets.Workload` (the same
workloads ``kvserve bench serve`` sends to real servers) against it and reports what
``bench serve`` reports: throughput, TTFT, ITL, TPOT, hit rate, and cost.
"""

from __future__ import annotations

import heapq
import logging
import random
from collections import deque
from dataclasses import dataclass, field

from kvserve import progress
from kvserve.bench.datasets import Workload
from kvserve.bench.serve import session_starts
from kvserve.bench.stats import Dist
from kvserve.engine.engine import Engine
from kvserve.engine.request import SamplingParams
from kvserve.errors import InvalidArgumentError
from kvserve.kv.manager import KVManager, window_tokens
from kvserve.kv.tiers import HostTier
from kvserve.sim.cost_model import Roofline
from kvserve.sim.hardware import Hardware
from kvserve.sim.models import BYTES, ModelSpec
from kvserve.sim.profiles import EngineProfile
from kvserve.sim.runner import SimRunner, VirtualClock


@dataclass
class Footprint:
    """Device memory of one replica, in GB."""

    weights_gb: float
    activations_gb: float
    draft_gb: float
    kv_gb_per_token: float
    kv_budget_gb: float  # what is left for the KV cache

    @property
    def fixed_gb(self) -> float:
        return self.weights_gb + self.activations_gb + self.draft_gb


def footprint(model: ModelSpec, profile: EngineProfile, hw: Hardware, tp: int = 1,
              mem_util: float = 0.9) -> Footprint:
    weights = model.weight_bytes(profile.weights) / 1e9
    # the largest step's activations: hidden states and MLP intermediates (16-bit), and fp32 logits
    tokens = min(profile.max_num_batched_tokens, 16384)
    inter = model.expert_intermediate * model.experts_per_token if model.experts else model.intermediate
    act = (tokens * (4 * model.hidden + 2 * inter) * 2 + profile.max_num_seqs * model.vocab * 4) / 1e9
    draft = profile.draft_params_b * BYTES[profile.weights]
    kv_tok = model.kv_bytes_per_token(profile.kv) / 1e9
    if profile.kv_memory_of_free:  # TensorRT-LLM: a fraction of what is free once weights are loaded
        budget = (hw.hbm_gb * tp - weights - act - draft) * mem_util
    else:  # vLLM's gpu_memory_utilization, SGLang's mem_fraction_static: a fraction of all memory
        budget = hw.hbm_gb * tp * mem_util - weights - act - draft
    return Footprint(weights, act, draft, kv_tok, budget)


def build_sim_engine(model: ModelSpec, hw: Hardware, profile: EngineProfile, *, tp: int = 1,
                     mem_util: float = 0.9, num_kv_blocks: int | None = None, host_tier_gb: float = 0.0,
                     max_model_len: int | None = None) -> tuple[Engine, SimRunner, VirtualClock]:
    clock = VirtualClock()
    fp = footprint(model, profile, hw, tp, mem_util)
    ctx = min(max_model_len or model.max_context, model.max_context)
    if profile.slots:  # unpaged: each slot reserves ctx // slots tokens up front, one "block" per slot
        block_size = max(1, ctx // profile.slots)
        blocks = profile.slots
        ctx = block_size
    else:
        block_size = profile.block_size
        blocks = num_kv_blocks or int(fp.kv_budget_gb / (fp.kv_gb_per_token * block_size))
    if blocks < 1 or (num_kv_blocks is None and fp.kv_budget_gb <= 0):
        raise InvalidArgumentError(
            f"{model.name} does not fit on {tp} x {hw.name} with {profile.name}'s precisions "
            f"(weights {fp.weights_gb:.1f} GB, activations {fp.activations_gb:.1f} GB)")
    config = profile.to_config()
    window = None if profile.slots else model.sliding_window
    if window is None or blocks * block_size < window_tokens(window, block_size, config.scheduler.max_num_batched_tokens):
        ctx = min(ctx, blocks * block_size)  # (a windowed sequence holds its window's blocks, whatever its length)
    runner = SimRunner(Roofline(model, hw, profile.weights, profile.kv, tp, profile.costs), profile, clock,
                       num_kv_blocks=blocks, block_size=block_size, max_model_len=ctx)
    tiers = [HostTier(int(host_tier_gb * 1e9), bandwidth=hw.host_link_gbps * 1e9)] if host_tier_gb else []
    kv = KVManager(blocks, block_size, enable_prefix_caching=config.cache.enable_prefix_caching, tiers=tiers,
                   fingerprint=runner.kv_fingerprint, block_bytes=runner.block_bytes,
                   sliding_window=window)
    engine = Engine(runner, config.scheduler, vocab_size=model.vocab, eos_token_ids=(), kv=kv, clock=clock)
    return engine, runner, clock


@dataclass
class SimRecord:
    sent: float
    prompt_tokens: int
    order: int = 0  # admission order: the first ``warmup_requests`` are warm-up
    token_times: list[float] = field(default_factory=list)
    cached_tokens: int = 0


@dataclass
class SimResult:
    profile: str
    hardware: str
    model: str
    devices: int
    requests: int
    completed: int
    rejected: int
    duration_s: float
    busy_fraction: float
    input_tokens: int
    output_tokens: int
    output_tokens_per_s: float
    request_throughput: float
    ttft_ms: Dist | None
    itl_ms: Dist | None
    tpot_ms: Dist | None
    e2e_ms: Dist | None
    prefix_hit_rate: float
    preemptions: int
    kv_blocks: int
    block_size: int
    price_per_hour: float
    # an offline run's steady rate: output tokens/s over the middle half of the output tokens (from
    # the 25th to the 75th percentile of their times), without its first fill and its drain tail; with
    # warm-up requests in a closed loop, the loop's rate from the measured requests (Little's law)
    steady_output_tokens_per_s: float = 0.0
    warmup_requests: int = 0
    # requests in flight on average over the run (bench_serving's "Concurrency": their end-to-end
    # times summed over the run's duration)
    mean_concurrency: float = 0.0

    def cost_per_million_output_tokens(self, utilization: float = 1.0) -> float:
        """USD per 1M output tokens with the devices busy ``utilization`` of the time at this rate."""
        per_s = self.output_tokens_per_s * utilization
        return self.price_per_hour * self.devices / (per_s * 3600) * 1e6 if per_s else float("inf")


@dataclass(frozen=True)
class Run:
    """One benchmark run against the simulated server: a workload, its arrivals, its client cap."""

    workload: Workload
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    # the first this many admitted requests only load the engine: latencies are the later requests',
    # and with ``max_concurrency`` the steady rate is the closed loop's
    warmup_requests: int = 0


def simulate(workload: Workload, model: ModelSpec, hw: Hardware, profile: EngineProfile, *, tp: int = 1,
             request_rate: float = float("inf"), max_concurrency: int | None = None, seed: int = 0,
             mem_util: float = 0.9, num_kv_blocks: int | None = None, host_tier_gb: float = 0.0,
             max_model_len: int | None = None, max_steps: int = 5_000_000, warmup_requests: int = 0) -> SimResult:
    """Replay ``workload`` on a fresh engine; with ``warmup_requests`` the first that many admitted
    requests only load the engine (a loop measured in steady state, as perf_analyzer's measurement
    windows do)."""
    run = Run(workload, request_rate, max_concurrency, warmup_requests)
    return simulate_runs([run], model, hw, profile, tp=tp, seed=seed, mem_util=mem_util, num_kv_blocks=num_kv_blocks,
                         host_tier_gb=host_tier_gb, max_model_len=max_model_len, max_steps=max_steps)[0]


def simulate_runs(runs: list[Run], model: ModelSpec, hw: Hardware, profile: EngineProfile, *, tp: int = 1,
                  seed: int = 0, mem_util: float = 0.9, num_kv_blocks: int | None = None, host_tier_gb: float = 0.0,
                  max_model_len: int | None = None, max_steps: int = 5_000_000) -> list[SimResult]:
    """Replay ``runs`` one after another on one engine, as benchmark runs against one server go: each
    starts once the last has drained, and finds the prefix cache (and tiers) as the last left them."""
    # the engine's "KV cache full ... --max-num-seqs" advice is for a server's operator; here the
    # count of preemptions is part of the result instead
    sched_log = logging.getLogger("kvserve.engine.scheduler")
    level = sched_log.level
    sched_log.setLevel(logging.ERROR)
    try:
        engine, runner, clock = build_sim_engine(model, hw, profile, tp=tp, mem_util=mem_util,
                                                 num_kv_blocks=num_kv_blocks, host_tier_gb=host_tier_gb,
                                                 max_model_len=max_model_len)
        return [_replay(engine, runner, clock, run, hw, profile, tp, seed, max_steps, k) for k, run in enumerate(runs)]
    finally:
        sched_log.setLevel(level)


def _replay(engine: Engine, runner: SimRunner, clock: VirtualClock, run: Run, hw: Hardware, profile: EngineProfile,
            tp: int, seed: int, max_steps: int, run_index: int) -> SimResult:
    workload, max_concurrency = run.workload, run.max_concurrency
    t0 = clock.now
    busy0, preempted0 = runner.busy_s, engine.scheduler.stats.num_preemptions
    starts = session_starts(workload, run.request_rate, random.Random(seed))
    arrivals = [(t0 + t, i, 0) for i, t in enumerate(starts)]
    heapq.heapify(arrivals)
    ready: deque[tuple[float, int, int]] = deque()  # arrived, waiting for a client slot
    sent: deque[tuple[float, float, int, int]] = deque()  # sent, not yet seen by the scheduler: (seen, sent, ...)
    # the times client slots fell free (None: no concurrency cap); a request is sent at the later of
    # its arrival and the slot it takes
    free_slots: deque[float] | None = deque([t0] * max_concurrency) if max_concurrency else None
    # an overlap event loop (SGLang's) forms step n+1 while step n runs: a request sent during step
    # n joins step n+2 at the earliest; others pick up what arrived before the step
    late_admission = profile.costs.late_admission
    # the engine's front end (HTTP, tokenizing, handing over) takes one request at a time: a burst of
    # requests reaches the scheduler spread out, one per front-end time
    frontend_s, frontend_token_s = profile.costs.frontend_per_request_s, profile.costs.frontend_per_token_s
    frontend_free = t0
    last_step_start = t0
    rejected = 0
    records: dict[str, SimRecord] = {}
    steps = 0
    progress.expect(workload.num_requests)
    while arrivals or ready or sent or engine.has_unfinished():
        while arrivals and arrivals[0][0] <= clock.now:
            t, si, ti = heapq.heappop(arrivals)
            ready.append((t, si, ti))
        while ready and (free_slots is None or free_slots):
            t, si, ti = ready.popleft()
            t = t if free_slots is None else max(t, free_slots.popleft())
            prompt_len = len(workload.sessions[si].turns[ti].prompt)
            frontend_free = max(t, frontend_free) + frontend_s + frontend_token_s * prompt_len
            sent.append((frontend_free, t, si, ti))
        cutoff = last_step_start if late_admission and engine.has_unfinished() else clock.now
        while sent and sent[0][0] <= cutoff:
            _, t, si, ti = sent.popleft()
            turn = workload.sessions[si].turns[ti]
            rid = f"{run_index}:{si}:{ti}"
            try:
                engine.add_request(rid, turn.prompt, SamplingParams(max_tokens=turn.max_tokens, ignore_eos=True))
            except InvalidArgumentError:
                rejected += 1
                progress.advance()
                if free_slots is not None:
                    free_slots.append(clock.now)
                continue
            records[rid] = SimRecord(t, len(turn.prompt), order=len(records))
        if not engine.has_unfinished():
            # idle until the next request arrives or gets through the front end
            if upcoming := [queue[0][0] for queue in (arrivals, sent) if queue]:
                clock.now = max(clock.now, min(upcoming))
            continue
        before = last_step_start = clock.now
        for req in engine.step():
            rec = records[req.request_id]
            rec.token_times.append(clock.now)
            rec.cached_tokens = req.num_cached_tokens
            if req.is_finished:
                if free_slots is not None:
                    free_slots.append(clock.now)
                progress.advance()
                _, si, ti = map(int, req.request_id.split(":"))
                if ti + 1 < len(workload.sessions[si].turns):
                    heapq.heappush(arrivals, (clock.now, si, ti + 1))
        steps += 1
        if clock.now == before:  # nothing could be scheduled
            if sent:  # requests the scheduler has not seen yet: the cutoff has caught up, or the front end will
                clock.now = max(clock.now, sent[0][0])
                continue
            if arrivals:
                clock.now = max(clock.now, arrivals[0][0])
            else:
                raise RuntimeError("simulation stalled: requests wait but nothing can be scheduled")
        if steps > max_steps:
            raise RuntimeError(f"simulation exceeded {max_steps} steps")
    return run_result(records, run, runner, hw, profile, tp, rejected, runner.busy_s - busy0,
                   engine.scheduler.stats.num_preemptions - preempted0)


def run_result(records: dict[str, SimRecord], run: Run, runner: SimRunner, hw: Hardware, profile: EngineProfile,
            tp: int, rejected: int, busy_s: float, preemptions: int) -> SimResult:
    """What ``bench serve`` reports of one run, from its requests' token times."""
    workload, max_concurrency, warmup_requests = run.workload, run.max_concurrency, run.warmup_requests
    done = [r for r in records.values() if r.token_times]
    measured = [r for r in done if r.order >= warmup_requests] if 0 < warmup_requests < len(done) else done
    duration = max((r.token_times[-1] for r in done), default=0.0) - min((r.sent for r in done), default=0.0)
    duration = max(duration, 1e-9)
    n_out = sum(len(r.token_times) for r in done)
    n_in = sum(r.prompt_tokens for r in done)
    itls = [b - a for r in measured for a, b in zip(r.token_times, r.token_times[1:])]
    tpots = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in measured
             if len(r.token_times) > 1]
    devices = tp * (2 if profile.disaggregated else 1)
    times = sorted(t for r in done for t in r.token_times)
    q1, q3 = (times[len(times) // 4], times[3 * len(times) // 4]) if times else (0.0, 0.0)
    steady = (len(times) // 2) / (q3 - q1) if q3 > q1 else n_out / duration
    if measured is not done and max_concurrency:
        # a full closed loop's rate by Little's law: c requests in flight, each taking its end-to-end
        # time (a window of wall time would depend on where it falls in the loop's prefill/decode cycle)
        e2e = sum(r.token_times[-1] - r.sent for r in measured) / len(measured)
        steady = max_concurrency * sum(len(r.token_times) for r in measured) / len(measured) / max(e2e, 1e-9)
    return SimResult(
        profile=profile.name, hardware=hw.key, model=runner.roofline.model.name, devices=devices,
        requests=workload.num_requests, completed=len(done), rejected=rejected, duration_s=round(duration, 3),
        busy_fraction=round(min(1.0, busy_s / duration), 3), input_tokens=n_in, output_tokens=n_out,
        output_tokens_per_s=round(n_out / duration, 2), request_throughput=round(len(done) / duration, 4),
        ttft_ms=Dist.of([r.token_times[0] - r.sent for r in measured]), itl_ms=Dist.of(itls),
        tpot_ms=Dist.of(tpots), e2e_ms=Dist.of([r.token_times[-1] - r.sent for r in measured]),
        prefix_hit_rate=round(sum(r.cached_tokens for r in done) / max(1, n_in), 4),
        preemptions=preemptions, kv_blocks=runner.num_kv_blocks,
        block_size=runner.block_size, price_per_hour=hw.price_per_hour,
        steady_output_tokens_per_s=round(steady, 2), warmup_requests=warmup_requests,
        mean_concurrency=round(sum(r.token_times[-1] - r.sent for r in done) / duration, 2),
    )
