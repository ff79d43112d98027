"""Replicas behind a router in the simulator: N colocated replicas, or P prefill and D decode replicas
with each prompt's KV moved between them over a KV link (disaggregated prefill, docs/scale-out.md).

Every replica is the engine's own scheduler and KV manager (``build_sim_engine``) on a virtual clock
of its own; the loop here advances them together in time order: it processes the next arrival or KV
hand-over whenever no replica with work is behind it, else steps the replica whose clock is earliest.
As ``kvserve router`` does, a request goes to the least loaded replica; with a split, its decode
replica is chosen (least loaded) when it arrives and its prefill replica (least loaded) computes the
prompt and samples the first token (TTFT). The prompt's full blocks then cross the link: they stream
while the prompt is computed (as the TCP connector sends chunk by chunk), one transfer at a time per
prefill replica's link, and land ``KVLink.seconds`` later at the decode replica, in a tier its prefix
lookup restores them from (as the real decode replica's received blocks); it then computes the last
partial block and decodes the rest.
"""

from __future__ import annotations

import heapq
import logging
import random
from dataclasses import dataclass, replace

from kvserve.bench.datasets import Workload
from kvserve.bench.serve import session_starts
from kvserve.engine.engine import Engine
from kvserve.engine.handoff import prompt_keys
from kvserve.engine.request import SamplingParams
from kvserve.errors import InvalidArgumentError
from kvserve.kv.tcp_connector import ReceivedBlocks
from kvserve.sim.hardware import Hardware
from kvserve.sim.models import ModelSpec
from kvserve.sim.profiles import EngineProfile
from kvserve.sim.runner import SimRunner, SizedPayload, VirtualClock
from kvserve.sim.simulate import Run, SimRecord, SimResult, build_sim_engine, run_result


@dataclass(frozen=True)
class KVLink:
    """The path a prompt's KV takes from a prefill to a decode replica: hops of (GB/s, latency s).
    A transfer pays every hop's latency and its bytes at the slowest hop's rate (the hops pipeline)."""

    hops: tuple[tuple[float, float], ...]

    def seconds(self, nbytes: float) -> float:
        return sum(lat for _, lat in self.hops) + nbytes / (min(g for g, _ in self.hops) * 1e9)

    @classmethod
    def of(cls, hw: Hardware, spec: str | None = None) -> KVLink:
        """``spec`` "GBPS:US,GBPS:US" (GB/s and microseconds per hop), else the device's own KV link."""
        if not spec:
            return cls(((hw.kv_link_gbps or hw.interconnect_gbps, hw.kv_link_latency_s),))
        hops = []
        for part in spec.split(","):
            gbps, _, us = part.partition(":")
            try:
                hop = (float(gbps), float(us or 0) / 1e6)
            except ValueError:
                hop = (0.0, -1.0)
            if not hop[0] > 0 or hop[1] < 0:
                raise InvalidArgumentError(f"--kv-link {spec!r}: each hop is GBPS:MICROSECONDS, e.g. 450:5,50:10",
                                           param="kv_link")
            hops.append(hop)
        return cls(tuple(hops))


@dataclass
class ClusterRun:
    result: SimResult
    records: list[SimRecord]  # each request's send time and token times
    prompt_tokens: dict[str, int]  # prompt tokens computed (not restored) by each role's replicas

    def attainment(self, ttft_s: float, tpot_s: float) -> float:
        """The share of requests whose TTFT and TPOT (from the first token to the last) both meet the SLOs."""
        def ok(r: SimRecord) -> bool:
            tpot = (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) if len(r.token_times) > 1 else 0.0
            return bool(r.token_times) and r.token_times[0] - r.sent <= ttft_s and tpot <= tpot_s

        return sum(map(ok, self.records)) / max(1, len(self.records))


class ReceivedPayload(SizedPayload):
    """A block that crossed the KV link into the decode replica's memory (``KVLink`` charged it):
    restoring it costs the step no copy (``SimRunner``)."""

    __slots__ = ()
    direct = True


@dataclass
class _Replica:
    role: str  # "both", "prefill" or "decode"
    engine: Engine
    runner: SimRunner
    clock: VirtualClock
    load: int = 0  # requests routed here and not finished
    link_free: float = 0.0  # a prefill replica's link is busy with earlier transfers until then


@dataclass(frozen=True)
class Layout:
    """Colocated (``prefill`` 0: ``decode`` replicas of role both) or split, ``tp`` devices each."""

    prefill: int
    decode: int
    tp: int = 1

    @property
    def devices(self) -> int:
        return (self.prefill + self.decode) * self.tp

    @property
    def name(self) -> str:
        return f"colocated x{self.decode}" if not self.prefill else f"split {self.prefill}P+{self.decode}D"


def simulate_cluster(workload: Workload, model: ModelSpec, hw: Hardware, profile: EngineProfile, layout: Layout,
                     *, link: KVLink | None = None, request_rate: float = float("inf"), seed: int = 0,
                     num_kv_blocks: int | None = None, max_steps: int = 5_000_000) -> ClusterRun:
    """Replay ``workload`` on ``layout``'s replicas behind a least-load router."""
    if layout.decode < 1 or layout.prefill < 0 or layout.tp < 1:
        raise InvalidArgumentError(f"{layout.name}: a layout needs a decode (or colocated) replica")
    link = link or KVLink.of(hw)
    sched_log = logging.getLogger("kvserve.engine.scheduler")
    level = sched_log.level
    sched_log.setLevel(logging.ERROR)
    try:
        return _Cluster(workload, model, hw, profile, layout, link, num_kv_blocks).run(request_rate, seed, max_steps)
    finally:
        sched_log.setLevel(level)


class _Cluster:
    def __init__(self, workload: Workload, model: ModelSpec, hw: Hardware, profile: EngineProfile, layout: Layout,
                 link: KVLink, num_kv_blocks: int | None):
        self.workload, self.hw, self.profile, self.layout, self.link = workload, hw, profile, layout, link
        self.replicas: list[_Replica] = []
        roles = ["prefill"] * layout.prefill + ["decode" if layout.prefill else "both"] * layout.decode
        for role in roles:
            engine, runner, clock = build_sim_engine(model, hw, profile, tp=layout.tp, num_kv_blocks=num_kv_blocks)
            if role == "decode":  # where blocks from the link land (the real replica's ``ReceivedBlocks``)
                engine.kv.tiers.tiers.append(ReceivedBlocks(1 << 62))
            self.replicas.append(_Replica(role, engine, runner, clock))
        self.records: dict[str, SimRecord] = {}
        self.decode_of: dict[str, _Replica] = {}
        self.started: dict[str, float] = {}  # when a split request's first chunk was computed

    def _least_loaded(self, role: str) -> _Replica:
        return min((r for r in self.replicas if r.role == role), key=lambda r: r.load)

    def _add(self, rep: _Replica, rid: str, at: float, prompt: list[int], max_tokens: int,
             first: list[int] | None = None) -> None:
        rep.clock.now = max(rep.clock.now, at)  # an idle replica waited until now; a busy one takes it next step
        rep.engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                               output_token_ids=first)

    def run(self, request_rate: float, seed: int, max_steps: int) -> ClusterRun:
        wl = self.workload
        events = [(t, 0, i, 0) for i, t in enumerate(session_starts(wl, request_rate, random.Random(seed)))]
        heapq.heapify(events)  # (time, kind: 0 arrival / 1 KV landed, session, turn)
        steps = 0
        while events or any(r.engine.has_unfinished() for r in self.replicas):
            busy = [r for r in self.replicas if r.engine.has_unfinished()]
            nxt = min(busy, key=lambda r: r.clock.now) if busy else None
            if events and (nxt is None or events[0][0] <= nxt.clock.now):
                self._event(*heapq.heappop(events))
                continue
            assert nxt is not None
            before = nxt.clock.now
            self._step(nxt, events)
            steps += 1
            if nxt.clock.now == before:  # nothing could run: wait for the next event
                if not events:
                    raise RuntimeError("simulation stalled: requests wait but nothing can be scheduled")
                nxt.clock.now = max(nxt.clock.now, events[0][0])
            if steps > max_steps:
                raise RuntimeError(f"simulation exceeded {max_steps} steps")
        done = list(self.records.values())
        busy_s = sum(r.runner.busy_s for r in self.replicas) / len(self.replicas)
        res = run_result(self.records, Run(wl, request_rate), self.replicas[-1].runner, self.hw, self.profile,
                         self.layout.tp, 0, busy_s, sum(r.engine.scheduler.stats.num_preemptions
                                                        for r in self.replicas))
        res = replace(res, profile=f"{self.profile.name} {self.layout.name}", devices=self.layout.devices,
                      completed=sum(1 for r in done if r.token_times))
        computed: dict[str, int] = {}
        for r in self.replicas:
            computed[r.role] = computed.get(r.role, 0) + r.engine.stats.prompt_tokens
        return ClusterRun(res, done, computed)

    def _event(self, t: float, kind: int, si: int, ti: int) -> None:
        turn = self.workload.sessions[si].turns[ti]
        rid = f"{si}:{ti}"
        if kind == 1:  # its KV landed at its decode replica: decode from the first token on
            rep = self.decode_of.pop(rid)
            full = len(turn.prompt) // rep.runner.block_size * rep.runner.block_size
            tier = rep.engine.kv.tiers.tiers[-1]
            for key, tokens in prompt_keys(rep.engine.kv.cache_root_key, turn.prompt[:full], rep.runner.block_size):
                tier.add(key, tokens, ReceivedPayload(rep.runner.block_bytes))  # type: ignore[arg-type]
            self._add(rep, rid, t, turn.prompt, turn.max_tokens, first=[0])
            return
        self.records[rid] = SimRecord(t, len(turn.prompt), order=len(self.records))
        if not self.layout.prefill:
            rep = self._least_loaded("both")
            rep.load += 1
            self._add(rep, rid, t, turn.prompt, turn.max_tokens)
            return
        if turn.max_tokens > 1:  # chosen now, as the router asks it for its connector before the prefill leg
            self.decode_of[rid] = dec = self._least_loaded("decode")
            dec.load += 1
        rep = self._least_loaded("prefill")
        rep.load += 1
        self._add(rep, rid, t, turn.prompt, 1)

    def _step(self, rep: _Replica, events: list) -> None:
        for req in rep.engine.step():
            rid = req.request_id
            rec = self.records[rid]
            rec.token_times.append(rep.clock.now)
            si, ti = map(int, rid.split(":"))
            if rep.role == "prefill":
                if not req.is_finished:
                    continue
                rep.load -= 1
                if rid in self.decode_of:
                    heapq.heappush(events, (self._landed(rep, rid, req.num_prompt_tokens), 1, si, ti))
                    continue
            else:
                rec.cached_tokens = req.num_cached_tokens
                if not req.is_finished:
                    continue
                rep.load -= 1
            if ti + 1 < len(self.workload.sessions[si].turns):
                heapq.heappush(events, (rep.clock.now, 0, si, ti + 1))
        if rep.role == "prefill":  # a prompt's first blocks go on the wire once its first chunk's step ended
            for req in rep.engine.scheduler.running:
                if req.num_computed_tokens:
                    self.started.setdefault(req.request_id, rep.clock.now)

    def _landed(self, rep: _Replica, rid: str, prompt_tokens: int) -> float:
        """When a prompt's KV is all at its decode replica: its bytes (each of the ``tp`` devices sends
        its share over its own link) left as the prompt was computed, after the link's earlier transfers."""
        full = prompt_tokens // rep.runner.block_size
        nbytes = full * rep.runner.block_bytes / self.layout.tp
        if not nbytes:
            return rep.clock.now
        latency = self.link.seconds(0.0)
        wire = self.link.seconds(nbytes) - latency
        begin = max(self.started.pop(rid, rep.clock.now), rep.link_free)
        rep.link_free = max(begin + wire, rep.clock.now)
        return max(rep.clock.now, begin + wire) + latency
