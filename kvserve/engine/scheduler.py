"""The scheduler: continuous batching under a token budget, chunked prefill, preemption.

Each step (vLLM V1 style): running requests first, in admission order, each getting what
it still needs (one token for a decode, a chunk for an unfinished prefill); then waiting
requests are admitted while the budget, the sequence cap and free KV blocks allow. With
``mixed_prefill`` off (SGLang's default) a step with prefill work carries prefill only. A new
request starts from its longest cached prefix and prefills only the rest; the waiting
queue is ordered by the schedule policy (fcfs, or cache-aware: lpm, dfs-weight) with a
starvation guard. When a running request cannot get a block, the newest running request
is preempted: its blocks are freed (its full blocks stay cached) and it waits again.
With speculative decoding on, a decoding request's pending draft rides in its chunk to be
verified, as many drafted tokens as the speculation policy (``kvserve.spec.policy``, called
at a few named points) finds worth their cost; after the step, the KV slots of rejected
drafts are given back. For a model whose every layer has a sliding window, each request lets go
of the blocks behind the window of its chunk's first row before its blocks are counted, so a
long sequence holds about its window's blocks and what it frees is free for others at once.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.config import SchedulerConfig, SpeculationConfig
from kvserve.engine.batch import Batch, ScheduledChunk, StepOutput
from kvserve.engine.inflight_prefix import blocks_filled_this_step, prefix_being_computed
from kvserve.engine.request import FinishReason, Request, RequestStatus
from kvserve.engine.step_cost import StepCostModel, StepFeatures
from kvserve.kv.manager import KVManager, PrefixMatch
from kvserve.lora.registry import adapter_fits
from kvserve.spec.policy import NoSpeculation, SpecPolicy, SpecStats, is_decoding

log = logging.getLogger(__name__)

PREEMPTION_LOG_INTERVAL_S = 10.0  # preemptions are logged at most this often (they come in bursts)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_steps: int = 0
    num_generated_tokens: int = 0
    spec: SpecStats = field(default_factory=SpecStats)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager, clock: Callable[[], float] = time.monotonic,
                 speculation: SpeculationConfig | None = None, max_loras: int = 0):
        """``speculation``: verify drafts as that config says (the runner must have a proposer); None: off.
        ``max_loras``: most distinct LoRA adapters among the running requests."""
        self.max_loras = max_loras
        self.config = config
        self.kv = kv
        self.clock = clock  # the simulator passes its virtual clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self.cost = StepCostModel()
        kv.prefill_seconds = self._predict_prefill
        self._prefill_time_left: float | None = None  # this step's time allowance for prefill
        self._prefill_chunks = 0
        self._unready_cap = False  # the time cap is on but its model not ready: minimal chunks
        self.spec: SpecPolicy | NoSpeculation = NoSpeculation()
        if speculation is not None:
            self.spec = SpecPolicy(speculation.num_speculative_tokens, self.cost,
                                   adaptive=speculation.adaptive_speculation)
        self.stats.spec = self.spec.stats
        self._gone: list[str] = []  # requests removed since the last step
        self._preemption_logged_at: float | None = None
        self._preempted_since_log = 0

    # -- queue management -------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        # pending tier copies count: a block saved to a shared tier when computed must get there
        # even if its request was the last one (the next step carries the copy)
        return bool(self.waiting or self.running or self.kv.has_pending_transfers)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def finish(self, request_id: str, reason: FinishReason, stop_reason: int | str | None = None) -> Request | None:
        """End a request from outside the step (abort, stop string); frees its blocks."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if not req.is_finished:
            req.finish(reason, stop_reason)
        self._remove(req)
        return req

    def _remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        self.requests.pop(req.request_id, None)
        self._gone.append(req.request_id)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.spec.on_preempt(req)
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- one step ------------------------------------------------------------------------
    def _chunk_size(self, req: Request, budget: int) -> int:
        """Tokens to schedule for ``req``: all it needs within the budget, prefill chunks capped by
        ``long_prefill_token_threshold`` and by this step's time allowance. 0 means not this step."""
        left = req.num_tokens - req.num_computed_tokens
        if not self.config.chunked_prefill and left > budget:
            return 0
        n = min(left, budget)
        if n <= 1:
            return n
        cap = self.config.long_prefill_token_threshold
        if cap > 0:
            n = min(n, cap)
        if req.long_prefill is None:
            req.long_prefill = req.num_prompt_tokens - req.num_computed_tokens > self.config.metered_prefill_min_tokens
        short = not req.long_prefill
        if self._prefill_time_left is not None:
            n = self._fit_in_time(req.num_computed_tokens, n, metered=not short)
        elif self._unready_cap and not short:
            n = min(n, self.config.min_prefill_chunk)
        return n

    def _fit_in_time(self, start: int, n: int, metered: bool = True) -> int:
        """The largest chunk (binary search) whose predicted cost fits the step's time allowance;
        an unmetered chunk goes whole and uses up allowance that metered ones then lack."""
        def cost(k: int) -> float:
            return self.cost.prefill_seconds(start, k)

        if not metered:
            self._prefill_time_left -= cost(n)  # type: ignore[operator]
            self._prefill_chunks += 1
            return n

        floor = self.config.min_prefill_chunk if self._prefill_chunks == 0 else 0
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cost(mid) <= self._prefill_time_left:
                lo = mid
            else:
                hi = mid - 1
        k = min(n, max(lo, floor))
        if k:
            self._prefill_time_left -= cost(k)
            self._prefill_chunks += 1
        return k

    def _plan_prefill_time(self) -> None:
        """While sequences decode, allow (long) prefill only (factor - 1) decode-steps' worth of time."""
        self._prefill_time_left, self._prefill_chunks, self._unready_cap = None, 0, False
        factor = self.config.prefill_step_factor
        if factor <= 0:
            return
        decoding = [r for r in self.running if is_decoding(r)]
        if not decoding:
            return
        if not self.cost.ready:  # no trustworthy model yet: long prompts go in minimal chunks
            self._unready_cap = True
            return
        decode_only = self.cost.decode_seconds(len(decoding), sum(r.num_tokens for r in decoding) / 1024)
        self._prefill_time_left = (factor - 1.0) * decode_only

    def _predict_prefill(self, start: int, n: int) -> float | None:
        return self.cost.prefill_seconds(start, n) if self.cost.ready else None

    def _order_waiting(self) -> None:
        """Cache-aware order of the waiting queue; requests past the starvation bound go first."""
        policy, cache = self.config.schedule_policy, self.kv.cache
        if policy == "fcfs" or cache is None or len(self.waiting) < 2 or len(self.waiting) > self.config.max_reorder_queue:
            return
        now = self.clock()
        starved = [r for r in self.waiting if now - r.arrival_time > self.config.starvation_timeout_s]
        rest = [r for r in self.waiting if now - r.arrival_time <= self.config.starvation_timeout_s]
        if policy == "lpm":
            rest.sort(key=lambda r: -cache.match_length(r.token_ids, r.cache_seed))  # stable: FCFS among equals
        else:
            rest = self._dfs_weight_order(rest)
        self.waiting = deque(starved + rest)

    def _dfs_weight_order(self, reqs: list[Request]) -> list[Request]:
        """SGLang's dfs-weight: walk the tree depth-first, heaviest subtree (most waiting
        requests under it) first, emitting each node's requests; keeps one branch hot."""
        cache = self.kv.cache
        assert cache is not None
        at: dict[int, list[Request]] = {}
        weight: dict[int, int] = {}
        for r in reqs:
            node = cache.deepest(r.token_ids, r.cache_seed)
            at.setdefault(id(node), []).append(r)
            while node is not None:
                weight[id(node)] = weight.get(id(node), 0) + 1
                node = node.parent
        # post-order: a node's heavier subtrees, then the requests that end at the node itself
        out: list[Request] = []
        stack: list[tuple[object, bool]] = [(root, False) for root in cache.roots()]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                out.extend(at.get(id(node), []))
                continue
            stack.append((node, True))
            kids = [c for c in node.children.values() if id(c) in weight]
            kids.sort(key=lambda c: weight[id(c)])  # heaviest popped first
            stack.extend((c, False) for c in kids)
        return out

    def observe_step(self, batch: Batch, seconds: float) -> None:
        """Feed a measured step time to the cost model."""
        self.cost.observe(StepFeatures.of(batch), seconds)

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.config.max_num_batched_tokens
        self._plan_prefill_time()
        # SGLang's default (no --enable-mixed-chunk): a step with prefill work carries only prefill
        # chunks, and the running requests' decodes wait for the next step
        prefill_only = not self.config.mixed_prefill and self._has_prefill_work()
        self.spec.begin_step(self.running)
        budget = self._schedule_running(batch, budget, decodes=not prefill_only)
        budget = self._admit(batch, budget)
        if prefill_only and not batch.chunks and not batch.preempted:
            self._schedule_running(batch, budget, decodes=True)  # nothing could be admitted: decode instead

        batch.kv_transfers = self.kv.take_transfers()
        batch.finished_request_ids, self._gone = self._gone, []
        if batch.preempted:
            self._log_preemptions(len(batch.preempted))
        self.stats.num_steps += 1
        return batch

    def _has_prefill_work(self) -> bool:
        """A running request's prompt is still being prefilled, or a waiting one could join."""
        return (any(not is_decoding(r) for r in self.running)
                or bool(self.waiting) and len(self.running) < self.config.max_num_seqs)

    def _schedule_running(self, batch: Batch, budget: int, decodes: bool = True) -> int:
        """Running requests first, in admission order, each what it still needs (``decodes`` False:
        prefill chunks only); preempts the newest when one cannot get a block. Returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if not decodes and is_decoding(req):
                i += 1
                continue
            n = self._chunk_size(req, budget)
            if n == 0:  # a prefill that does not fit this step's time
                i += 1
                continue
            self.kv.slide(req.request_id, req.num_computed_tokens)  # the chunk's first row (and drafts') window
            drafts = self.spec.drafts_to_verify(req, budget)
            if drafts and not self.kv.can_grow(req.request_id, req.num_computed_tokens + n + len(drafts)):
                drafts = []  # never preempt anyone for a draft
            while not self.kv.can_grow(req.request_id, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            else:
                n += len(drafts)
                self.kv.grow(req.request_id, req.num_computed_tokens + n)
                self._add_chunk(batch, req, n, drafts)
                budget -= n
                i += 1
                continue
            break  # req preempted itself: nothing behind it can fit either
        return budget

    def _admit(self, batch: Batch, budget: int) -> int:
        """Admit waiting requests while the budget, the sequence cap and free blocks allow, and only
        when nobody had to be preempted this step. Returns the budget left."""
        if self.config.static_batching and self.running:
            budget = 0  # batch-then-wait: nothing joins until the batch has drained
        if self.waiting and not batch.preempted and budget > 0:
            self._order_waiting()
        deferred: list[Request] = []
        while self.waiting and budget > 0 and not batch.preempted and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not adapter_fits(self.running, req, self.max_loras):  # its adapter waits for a slot
                deferred.append(self.waiting.popleft())
                continue
            # a request that wants its prompt's logprobs runs the whole prompt, as in vLLM
            uncached = req.needs_prompt_logprobs
            match = PrefixMatch() if uncached else self.kv.match_prefix(req.request_id, req.token_ids, req.cache_seed)
            overlaps = not uncached and self.kv.cache is not None  # may overlap a prefix still being computed
            if overlaps and self.config.share_prefix_in_step:
                bs = self.kv.block_size
                if computing := blocks_filled_this_step(batch.chunks, req, match.num_tokens, bs, self.kv.table):
                    self.kv.share_computing(req.request_id, computing, match)
            req.num_computed_tokens = match.num_tokens
            if overlaps and prefix_being_computed(self.running, req, match.num_tokens, self.kv.block_size):
                # a running request is prefilling the same prefix right now: wait for its blocks
                # to land in the cache instead of computing them a second time
                self.kv.free(req.request_id)
                req.num_computed_tokens = 0
                deferred.append(self.waiting.popleft())
                continue
            n = self._chunk_size(req, budget)
            if n:  # a hit's blocks behind the first row's window go back before the blocks are counted
                self.kv.slide(req.request_id, req.num_computed_tokens)
            if n == 0 or not self.kv.can_grow(req.request_id, req.num_computed_tokens + n):
                self.kv.free(req.request_id)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if not uncached:
                self.kv.record_admission(req.num_prompt_tokens, match)
            if req.num_preemptions == 0:
                req.num_cached_tokens = match.num_tokens
                req.scheduled_time = self.clock()
                req.restored_blocks = {t: n // self.kv.block_size for t, n in match.tier_tokens.items()}
            self.kv.grow(req.request_id, req.num_computed_tokens + n)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add_chunk(batch, req, n)
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        return budget

    def _add_chunk(self, batch: Batch, req: Request, n: int, drafts: list[int] | None = None) -> None:
        chunk = ScheduledChunk(req, req.num_computed_tokens, n, self.kv.table(req.request_id), drafts or [],
                               state_slot=self.kv.state_slot(req.request_id))
        if chunk.sample:
            chunk.propose_k = self.spec.propose_k(req)
        batch.chunks.append(chunk)

    def _log_preemptions(self, n: int) -> None:
        """One line per burst of preemptions (at most one per PREEMPTION_LOG_INTERVAL_S), not one per
        sequence: under KV pressure a log line per victim would flood the log."""
        self._preempted_since_log += n
        now = self.clock()
        if self._preemption_logged_at is not None and now - self._preemption_logged_at < PREEMPTION_LOG_INTERVAL_S:
            return
        log.warning("KV cache full: %d request(s) preempted (their KV freed, to be recomputed) since the last "
                    "such message; %d in all. Fewer concurrent sequences (--max-num-seqs) or a larger KV cache "
                    "avoid it", self._preempted_since_log, self.stats.num_preemptions)
        self._preemption_logged_at, self._preempted_since_log = now, 0

    def update(self, batch: Batch, output: StepOutput) -> list[Request]:
        """Advance the scheduled requests by the step's result; return those that changed."""
        changed: list[Request] = []
        for chunk in batch.chunks:
            req = chunk.request
            if req.is_finished:  # ended from outside while its step ran
                continue
            if req.request_id in output.prompt_logprobs:
                req.prompt_logprobs.extend(output.prompt_logprobs[req.request_id])
            if not chunk.sample:
                req.num_computed_tokens = chunk.end
                self.kv.cache_blocks(req.request_id, req.token_ids, chunk.end, req.cache_seed)
                continue
            tokens = output.token_ids[req.request_id]
            logprobs = output.logprobs.get(req.request_id, [])
            drafted = len(chunk.draft_token_ids)
            # the KV of the chunk's first token and of the accepted drafts is valid; the rest is not
            req.num_computed_tokens = chunk.end - drafted + len(tokens) - 1
            for j, token in enumerate(tokens):
                if j < len(logprobs):
                    req.logprobs.append(logprobs[j])
                req.append_token(token)
                self.stats.num_generated_tokens += 1
                if req.is_finished:
                    break
            self.kv.cache_blocks(req.request_id, req.token_ids, min(req.num_computed_tokens, req.num_tokens - 1),
                                 req.cache_seed)
            if drafted:
                self.kv.trim(req.request_id, req.num_tokens)  # give back the rejected drafts' slots
            self.spec.on_result(req, chunk.is_decode, drafted, len(tokens) - 1)
            req.spec.draft_token_ids = output.draft_token_ids.get(req.request_id, [])
            changed.append(req)
            if req.is_finished:
                self._remove(req)
        return changed
