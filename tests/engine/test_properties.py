"""Property-based tests: the scheduler and the KV manager driven by random operation sequences.

Hypothesis draws an engine configuration (tiny KV pools that force preemption, prefix caching
on/off, a host offload tier on/off, small or large chunked-prefill budgets, speculative decoding
with fixed drafts) and then a random sequence of operations (add a request, abort one, stop one
from outside, step the engine), checking invariants after every step. At the end of every
example the engine is run until nothing is left, which must happen in a bounded number of
steps, and every request must have ended properly and given all its blocks back.

No model and no torch: a fake runner stands in. It keeps a simulated KV memory (per block slot,
a hash of the token prefix the slot's KV was computed from), checks that every chunk it runs
finds the KV of its earlier positions intact in its block table (prefix-cache sharing, tier
restores and speculative rollbacks included), and that it only ever writes to blocks no one
else holds. Offload payloads carry the simulated memory of the block, so a restore is checked
too.
"""

from __future__ import annotations

import os
import random
import struct
import tempfile

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvserve.engine.batch import Batch, StepOutput
from kvserve.engine.engine import Engine
from kvserve.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from kvserve.config import SCHEDULE_POLICIES, SchedulerConfig, SpeculationConfig
from kvserve.kv.manager import KVManager
from kvserve.kv.tiers import HostTier

EOS = 2
VOCAB = [3, 4, 5, 6]  # small: prompts and outputs share prefixes, so the radix cache is exercised
UNWRITTEN = -1  # hash() never returns -1: marks a KV slot nothing was written to
MAX_DRAIN_STEPS = 2000

# hypothesis keeps caches under ./.hypothesis (even with database=None); keep them out of the repository
if "HYPOTHESIS_STORAGE_DIRECTORY" not in os.environ:
    set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "kvserve-hypothesis"))


def prefix_hashes(tokens: list[int]) -> list[int]:
    """h[p]: the simulated KV of position p, a function of tokens[0..p] (as real KV is)."""
    out, h = [], 0
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeRunner:
    """Executes a batch on a simulated KV memory and samples random tokens."""

    def __init__(self, kv: KVManager, num_blocks: int, block_size: int, clock: FakeClock, p_eos: float):
        self.kv = kv
        self.num_kv_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = num_blocks * block_size
        self.block_bytes = 8 * block_size  # one int64 per slot: the payload is the block's memory
        self.kv_fingerprint = b"fake"
        self.clock = clock
        self.p_eos = p_eos
        self.rng = random.Random(0)
        self.mem = [[UNWRITTEN] * block_size for _ in range(num_blocks)]
        self.proposed: dict[str, list[int]] = {}  # each request's draft from its last sampling step
        self.num_verifies = 0
        self.num_saves = 0
        self.num_loads = 0
        self.during_execute = None  # called once the step's work is done, before the engine sees the output

    def token(self) -> int:
        return EOS if self.rng.random() < self.p_eos else self.rng.choice(VOCAB)

    def execute(self, batch: Batch) -> StepOutput:
        bs, pool = self.block_size, self.kv.pool
        out = StepOutput()
        # tier copies first, in order (a saved block may be reused by this very step)
        for t in batch.kv_transfers:
            if t.kind == "save":
                assert UNWRITTEN not in self.mem[t.block], f"saving block {t.block} that was never fully computed"
                out.saved_kv[t.key] = struct.pack(f"<{bs}q", *self.mem[t.block])
                self.num_saves += 1
            else:
                assert t.kind == "load" and t.payload is not None
                self.mem[t.block] = list(struct.unpack(f"<{bs}q", t.payload))
                self.num_loads += 1

        seen: set[str] = set()
        written: set[tuple[int, int]] = set()
        for c in batch.chunks:
            req = c.request
            rid = req.request_id
            assert rid not in seen, f"{rid} scheduled twice in one step"
            seen.add(rid)
            assert c.num_tokens >= 1
            table = c.block_table
            assert table == self.kv.table(rid), f"{rid}: chunk's block table is not the manager's"
            assert len(set(table)) == len(table), f"{rid}: a block twice in one table {table}"
            assert len(table) * bs >= c.end, f"{rid}: table of {len(table)} blocks cannot hold {c.end} tokens"
            if c.draft_token_ids:
                assert c.start == req.num_tokens - 1 and c.sample, f"{rid}: verify chunk that is not a decode"
                last = self.proposed.get(rid, [])
                assert c.draft_token_ids == last[: len(c.draft_token_ids)], \
                    f"{rid}: verifies {c.draft_token_ids}, but its last proposed draft was {last}"
            seq = req.token_ids[: c.start] + c.input_token_ids
            assert len(seq) == c.end
            want = prefix_hashes(seq)
            # the KV of every earlier position must be in the table, computed from the same prefix
            for p in range(c.start):
                got = self.mem[table[p // bs]][p % bs]
                assert got == want[p], f"{rid}: KV of position {p} (block {table[p // bs]}) is wrong or missing"
            # writes only go to blocks not in the prefix cache, held by this sequence alone or also by
            # later chunks of this step that only read them (a prefix shared as it is computed)
            for p in range(c.start, c.end):
                b = table[p // bs]
                readers = sum(1 for o in batch.chunks[batch.chunks.index(c) + 1 :]
                              if b in o.block_table and o.start >= (o.block_table.index(b) + 1) * bs)
                assert pool.ref_count(b) == 1 + readers and not pool.is_cached(b), \
                    f"{rid}: writes position {p} into block {b} (refcount {pool.ref_count(b)}, cached {pool.is_cached(b)})"
                assert (b, p % bs) not in written, f"block {b} slot {p % bs} written twice in one step"
                written.add((b, p % bs))
                self.mem[b][p % bs] = want[p]

            if c.sample:
                drafts = c.draft_token_ids
                if drafts:
                    self.num_verifies += 1
                    accepted = self.rng.randint(0, len(drafts))
                    tokens = drafts[:accepted] + [self.token()]
                else:
                    tokens = [self.token()]
                out.token_ids[rid] = tokens
                draft = [self.token() for _ in range(self.rng.randint(0, c.propose_k))] if c.propose_k > 0 else []
                if draft:
                    out.draft_token_ids[rid] = draft
                self.proposed[rid] = draft
            else:
                assert not c.draft_token_ids and c.propose_k == 0
        self.clock.now += 0.01 + 0.0005 * batch.num_tokens
        if self.during_execute is not None:
            self.during_execute()
            # the scheduler does not count the verify of a request that ended while its step ran
            self.num_verifies -= sum(1 for c in batch.chunks if c.draft_token_ids and c.request.is_finished)
        return out


class EngineMachine(RuleBasedStateMachine):
    """Random operations on an Engine whose runner is fake; invariants after every step."""

    force: dict[str, object] = {}  # configuration values a subclass pins instead of drawing

    def __init__(self) -> None:
        super().__init__()
        self.ok = False  # set once a rule completes, so teardown never hides the rule's own failure

    # -- setup ------------------------------------------------------------------------------
    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        def draw(strategy, label):
            return self.force[label] if label in self.force else data.draw(strategy, label=label)

        bs = draw(st.integers(2, 4), "block_size")
        nb = draw(st.integers(8, 24), "num_blocks")
        caching = draw(st.booleans(), "prefix_caching")
        host = caching and draw(st.booleans(), "host_tier")
        chunked = draw(st.sampled_from([True, True, True, False]), "chunked_prefill")
        budget = draw(st.integers(4, 64), "max_num_batched_tokens")
        if not chunked:  # without chunking a prompt runs whole: the budget must hold any sequence
            budget = max(budget, nb * bs)
        k = draw(st.sampled_from([0, 3]), "num_speculative_tokens")
        cfg = SchedulerConfig(
            max_num_seqs=draw(st.integers(1, 8), "max_num_seqs"),
            max_num_batched_tokens=budget,
            long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3]), "long_prefill_token_threshold"),
            prefill_step_factor=draw(st.sampled_from([0.0, 0.0, 1.5]), "prefill_step_factor"),
            min_prefill_chunk=draw(st.sampled_from([16, 2]), "min_prefill_chunk"),
            metered_prefill_min_tokens=draw(st.sampled_from([1024, 4]), "metered_prefill_min_tokens"),
            schedule_policy=draw(st.sampled_from(SCHEDULE_POLICIES), "schedule_policy"),
            starvation_timeout_s=draw(st.sampled_from([10.0, 0.05]), "starvation_timeout_s"),
            chunked_prefill=chunked,
            static_batching=draw(st.sampled_from([False, False, False, True]), "static_batching"),
        )
        # always draft k: drafts are really verified
        spec = SpeculationConfig("ngram", num_speculative_tokens=k, adaptive_speculation=False) if k else None
        p_eos = draw(st.sampled_from([0.0, 0.1, 0.3]), "p_eos")
        tiers = []
        if host:
            cap = draw(st.integers(1, 2 * nb), "host_tier_blocks") * 8 * bs
            bw = draw(st.sampled_from([1e9, 2e3]), "host_bandwidth")  # slow: restores are sometimes skipped
            tiers = [HostTier(cap, bandwidth=bw, latency=0.0)]
        self.clock = FakeClock()
        self.kv = KVManager(nb, bs, enable_prefix_caching=caching, tiers=tiers, block_bytes=8 * bs)
        self.runner = FakeRunner(self.kv, nb, bs, self.clock, p_eos)
        self.engine = Engine(self.runner, cfg, eos_token_ids=(EOS,), kv=self.kv, clock=self.clock,
                             speculation=spec)
        self.cfg = cfg
        self.capacity = nb * bs
        self.bases = [draw(st.lists(st.sampled_from(VOCAB), min_size=bs, max_size=4 * bs), f"base{i}") for i in range(3)]
        self.added: dict[str, Request] = {}
        self.ended_outside: dict[str, FinishReason] = {}  # aborted or stopped from outside
        self.next_id = 0
        for _ in range(draw(st.integers(0, 8), "initial requests")):
            self._add_one(data)
        self.ok = True

    # -- operations -------------------------------------------------------------------------
    def _add_one(self, data: st.DataObject) -> None:
        draw = data.draw
        max_tokens: int | None = min(draw(st.integers(1, 20), label="max_tokens"), self.capacity - 1)
        base = draw(st.sampled_from(self.bases), label="base")
        # mostly the whole base prefix (so prompts share blocks), sometimes a cut of it
        cut = draw(st.one_of(st.just(len(base)), st.integers(0, len(base))), label="cut")
        suffix = draw(st.lists(st.sampled_from(VOCAB), max_size=6), label="suffix")
        prompt = (base[:cut] + suffix)[: self.capacity - max_tokens] or [VOCAB[0]]
        if draw(st.sampled_from([False, False, False, False, True]), label="max_tokens=None"):
            max_tokens = None  # up to the context window, which is the whole pool
        ignore_eos = draw(st.booleans(), label="ignore_eos")
        stop_token_ids = draw(st.sampled_from([[], [], [], [VOCAB[2]]]), label="stop_token_ids")
        rid = f"r{self.next_id}"
        self.next_id += 1
        # prompt + max_tokens fits the pool (and the context window): it can always finish alone
        assert len(prompt) + (max_tokens or 0) <= self.capacity and len(prompt) < self.capacity
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids)
        req = self.engine.add_request(rid, prompt, params)
        assert self.limit(req) >= 1
        self.added[rid] = req

    @rule(data=st.data(), n=st.integers(1, 3))
    def add(self, data: st.DataObject, n: int) -> None:
        self.ok = False
        for _ in range(n):
            self._add_one(data)
        self.ok = True

    @rule(seed=st.integers(0, 2**16), n=st.integers(1, 8))
    def step(self, seed: int, n: int) -> None:
        self.ok = False
        self.runner.rng.seed(seed)
        for _ in range(n):
            self.engine.step()
            self.check()
        self.ok = True

    @rule(data=st.data(), seed=st.integers(0, 2**16))
    def step_with_abort_during_execute(self, data: st.DataObject, seed: int) -> None:
        """A request aborted while its step runs: the step's result for it must be dropped."""
        running = sorted(r.request_id for r in self.engine.scheduler.running)
        if not running:
            return
        self.ok = False
        rid = data.draw(st.sampled_from(running), label="aborted mid-step")
        self.runner.rng.seed(seed)
        self.runner.during_execute = lambda: self.engine.abort(rid)
        try:
            self.engine.step()
        finally:
            self.runner.during_execute = None
        req = self.added[rid]
        assert req.finish_reason is FinishReason.ABORT and rid not in self.kv.tables
        self.ended_outside[rid] = FinishReason.ABORT
        self.check()
        self.ok = True

    @rule(data=st.data(), stop=st.booleans())
    def end_from_outside(self, data: st.DataObject, stop: bool) -> None:
        """An abort (client gone) or a stop string found by the detokenizer, between steps."""
        if not self.engine.scheduler.requests or not data.draw(st.booleans(), label="really"):
            return  # (half the time a no-op: most requests should run to their end)
        self.ok = False
        rid = data.draw(st.sampled_from(sorted(self.engine.scheduler.requests)), label="victim")
        reason = FinishReason.STOP if stop else FinishReason.ABORT
        req = self.engine.finish(rid, reason) if stop else self.engine.abort(rid)
        assert req is self.added[rid] and req.finish_reason is reason and req.is_finished
        self.ended_outside[rid] = reason
        assert rid not in self.kv.tables and rid not in self.engine.scheduler.requests
        self.check()
        self.ok = True

    @rule(data=st.data())
    def abort_finished_is_a_no_op(self, data: st.DataObject) -> None:
        self.ok = False
        done = sorted(rid for rid, r in self.added.items() if r.is_finished)
        if done:
            rid = data.draw(st.sampled_from(done), label="finished")
            req = self.added[rid]
            before = (req.finish_reason, len(req.token_ids))
            assert self.engine.abort(rid) is None
            assert (req.finish_reason, len(req.token_ids)) == before
        self.ok = True

    # -- invariants -------------------------------------------------------------------------
    @staticmethod
    def limit(r: Request) -> int:
        """The most output tokens ``r`` may get: max_tokens, else what the context window leaves."""
        window = r.max_total_tokens - r.num_prompt_tokens
        return window if r.params.max_tokens is None else min(r.params.max_tokens, window)

    @invariant()
    def invariants_hold(self) -> None:
        if hasattr(self, "engine"):
            self.check()

    def check(self) -> None:
        s, kv, pool, bs = self.engine.scheduler, self.kv, self.kv.pool, self.kv.block_size
        kv.check()  # exact refcounts, cached flags, free and evictable counts

        waiting = [r.request_id for r in s.waiting]
        running = [r.request_id for r in s.running]
        assert len(set(waiting)) == len(waiting), f"a request twice in the waiting queue: {waiting}"
        assert len(set(running)) == len(running), f"a request twice in the running list: {running}"
        assert not set(waiting) & set(running), f"waiting and running: {set(waiting) & set(running)}"
        assert set(s.requests) == set(waiting) | set(running)
        assert len(running) <= self.cfg.max_num_seqs
        # only running sequences hold blocks (a preempted or deferred one gave its blocks back)
        assert set(kv.tables) == set(running), (sorted(kv.tables), running)

        free = set(pool._free)
        owners: dict[int, list[str]] = {}
        for r in s.running:
            rid = r.request_id
            assert r.status is RequestStatus.RUNNING and not r.is_finished
            # the last token's KV is always still to compute (it is the next step's input)
            assert 0 <= r.num_computed_tokens < r.num_tokens, (rid, r.num_computed_tokens, r.num_tokens)
            table = kv.tables[rid]
            assert len(set(table)) == len(table), f"{rid}: a block twice in its table"
            assert len(table) * bs >= r.num_computed_tokens, f"{rid}: table too short for its computed tokens"
            assert len(table) <= pool.blocks_for(r.num_tokens), f"{rid}: holds blocks past its tokens {table}"
            assert r.num_output_tokens < self.limit(r)
            for b in table:
                assert b not in free and pool.ref_count(b) >= 1, f"{rid}: block {b} in its table is free"
                owners.setdefault(b, []).append(rid)
            # the KV of its computed tokens is in its blocks
            want = prefix_hashes(r.token_ids[: r.num_computed_tokens])
            for p, h in enumerate(want):
                assert self.runner.mem[table[p // bs]][p % bs] == h, f"{rid}: computed KV of position {p} is lost"
        for b, who in owners.items():
            if len(who) > 1:  # a shared block is never freed while referenced
                assert pool.ref_count(b) >= 2 and b not in free, (b, who, pool.ref_count(b))
        for r in s.waiting:
            assert r.status is RequestStatus.WAITING and r.num_computed_tokens == 0, r.request_id
            assert r.num_output_tokens < self.limit(r)
        for rid, r in self.added.items():
            assert r.num_output_tokens <= self.limit(r), rid

        # every block in the prefix cache holds the KV of exactly the prefix its path spells
        if kv.cache is not None:
            for node in kv.cache._nodes():
                path, n = [], node
                while n.parent is not None:
                    path.append(n.tokens)
                    n = n.parent
                tokens = [t for blk in reversed(path) for t in blk]
                assert len(tokens) == node.depth * bs
                assert self.runner.mem[node.block] == prefix_hashes(tokens)[-bs:], \
                    f"cached block {node.block} does not hold the KV of {tokens}"

    # -- the end of every example -------------------------------------------------------------
    def teardown(self) -> None:
        if not self.ok or not hasattr(self, "engine"):
            return
        e = self.engine
        steps = 0
        while e.has_unfinished():
            assert steps < MAX_DRAIN_STEPS, (
                f"livelock: {len(e.scheduler.waiting)} waiting, {len(e.scheduler.running)} running "
                f"after {MAX_DRAIN_STEPS} steps")
            e.step()
            self.check()
            steps += 1

        for rid, r in self.added.items():
            assert r.is_finished, rid
            out = r.output_token_ids
            assert len(out) <= self.limit(r), rid
            if rid in self.ended_outside:
                assert r.finish_reason is self.ended_outside[rid], rid
                continue
            assert r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), (rid, r.finish_reason)
            stops = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else {EOS})
            if r.finish_reason is FinishReason.STOP:
                assert out and out[-1] in stops, (rid, out)
            else:
                assert len(out) == self.limit(r), (rid, out)
            assert not stops & set(out[:-1]), (rid, out)  # nothing generated past a stop

        kv, pool = self.kv, self.kv.pool
        kv.check()
        assert not kv.tables and not kv._cached_upto and not e.scheduler.requests
        # every block is free or held by the prefix cache alone
        assert pool.num_free + pool.num_evictable == pool.num_blocks, (pool.num_free, pool.num_evictable)
        if kv.cache is None:
            assert pool.num_free == pool.num_blocks
        # what the example exercised (pytest --hypothesis-show-statistics)
        event("drain steps", f"{min(steps, 50) // 10 * 10}+")
        for name, hit in [("preemption", e.scheduler.stats.num_preemptions > 0),
                          ("prefix-cache hit", kv.stats.hits > 0), ("tier save", self.runner.num_saves > 0),
                          ("tier load", self.runner.num_loads > 0), ("verify", self.runner.num_verifies > 0),
                          ("aborted/stopped", bool(self.ended_outside))]:
            event(name, "yes" if hit else "no")
        st_ = e.scheduler.stats.spec
        assert st_.num_verifies == self.runner.num_verifies
        assert st_.num_emitted_tokens == st_.num_accepted_tokens + st_.num_verifies
        assert sum(st_.accepted_length_counts) == st_.num_verifies


EngineMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    database=None,  # no .hypothesis directory in the repository
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    print_blob=True,
)
TestEngineProperties = EngineMachine.TestCase


class TieredCacheMachine(EngineMachine):
    """Prefix caching with a host tier over a small pool: evictions, offloads and restores."""

    force = {"prefix_caching": True, "host_tier": True, "chunked_prefill": True, "static_batching": False}


TieredCacheMachine.TestCase.settings = settings(EngineMachine.TestCase.settings, max_examples=100)
TestTieredCacheProperties = TieredCacheMachine.TestCase
