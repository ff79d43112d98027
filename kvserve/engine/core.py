"""The engine core: the engine as a service that speaks messages, with no transport in it.

Commands go in (``add``, ``abort``, ``ReportState``, and the model commands ``Sleep``, ``WakeUp``,
``UpdateWeights``, which run between steps once the requests in flight are done: ``model_ops``); each ``step`` runs one engine step and returns
one ``StepMessage``: per-request deltas (new token ids, logprobs, finish), the requests refused,
the block hashes the prefix cache stored and removed (a replica's KV events), a stats snapshot,
and, when asked for, the engine's live state (``kvserve.engine.live_state``). A request whose grammar must first compile waits off the step path (the compile
cache's thread) and joins the engine once it is ready; one whose prompt's KV comes from a prefill replica
waits likewise for it (``kvserve.engine.handoff``). Transports wrap it: the
multiprocessing worker (``kvserve.engine.worker``), the in-process ``LLM``, a Ray actor.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import replace

from kvserve.engine.engine import Engine
from kvserve.engine.handoff import Handoff
from kvserve.engine.live_state import EngineState, capture_state
from kvserve.engine.memory import resident_memory_bytes
from kvserve.engine.messages import (
    AbortRequests,
    AddRequest,
    CommandReply,
    EngineReady,
    LoRACommand,
    EngineStatsSnapshot,
    ReportState,
    RequestDelta,
    RequestRejected,
    RequestTimeline,
    Shutdown,
    Sleep,
    StepMessage,
    UpdateWeights,
    WakeUp,
)
from kvserve.engine.model_ops import SLEEPING, ModelOps
from kvserve.engine.request import Request
from kvserve.errors import InvalidArgumentError, KVServeError, NotFoundError, ServiceUnavailableError
from kvserve.kv.prefix_view import PrefixTreeView

log = logging.getLogger(__name__)

# The prefix tree's summary is the costly part of a live state (a walk of up to 10,000 nodes, ~15 ms
# here: docs/ui.md): redone at most this often; requests and blocks are fresh on every ask.
TREE_INTERVAL_S = 1.0


class EngineCore:
    def __init__(self, engine: Engine, model_name: str, handoff: Handoff | None = None):
        """``handoff``: this replica's side of disaggregated prefill (None: requests that ask for it are refused)."""
        self.engine = engine
        self.handoff = handoff
        self._early: list[RequestDelta] = []  # first tokens a prefill replica sampled, out before the KV is in
        self.model_name = model_name
        self._sent: dict[str, int] = {}  # output tokens already reported, per request
        # requests whose grammar compiles on the compile cache's threads, off the step path
        self._compiling: dict[str, tuple[AddRequest, Future]] = {}
        self._rejected: list[RequestRejected] = []
        self._traced: set[str] = set()  # requests whose first delta carries their timeline
        self._commands_since_message = False  # a message goes out after commands, even with no tokens
        self._state_asked = False  # a ReportState came: the next message carries an EngineState
        self._tree: tuple[float, PrefixTreeView | None] | None = None  # the last tree summary, and when
        self._replies: list[CommandReply] = []  # commands done since the last message: one channel for all
        self.lora = getattr(engine.runner, "lora", None)  # the runner's LoRAManager (None: LoRA off)
        if self.lora is not None:
            s = engine.scheduler
            self.lora.in_use = lambda: {r.lora.id for q in (s.running, s.waiting) for r in q if r.lora is not None}
        self.tree_interval_s = TREE_INTERVAL_S
        engine.kv.record_events()  # each message says what the prefix cache stored and removed
        self.model_ops = ModelOps(engine)

    def ready(self) -> EngineReady:
        e = self.engine
        return EngineReady(self.model_name, e.max_model_len, e.vocab_size, e.kv.pool.num_blocks, e.kv.block_size,
                           resident_memory_bytes=resident_memory_bytes(),
                           kv_bytes_per_token=kv_bytes_per_token(e.runner),
                           prefix_caching=e.kv.cache is not None, cache_root_key=e.kv.cache_root_key,
                           kv_transfer_address=self.handoff.connector.address if self.handoff else "",
                           lora_adapters=None if self.lora is None else self.lora.names)

    @property
    def has_work(self) -> bool:
        """Requests to step, refusals or command results to report, model commands to run (requests
        waiting for a grammar not counted)."""
        ops = self.model_ops
        return self.engine.has_unfinished() or bool(self._rejected or self._early or ops.pending or self._replies)

    @property
    def is_compiling(self) -> bool:
        """Requests wait off the step path (a grammar compiling, a prompt's KV arriving): poll soon."""
        return bool(self._compiling) or (self.handoff is not None and self.handoff.has_parked)

    # -- commands -----------------------------------------------------------------------------
    def handle(self, cmd: AddRequest | AbortRequests | ReportState | LoRACommand | Shutdown | Sleep | WakeUp
               | UpdateWeights) -> bool:
        """Apply one command; False for Shutdown."""
        if isinstance(cmd, AddRequest):
            self.add(cmd)
        elif isinstance(cmd, AbortRequests):
            self.abort(cmd.request_ids)
        elif isinstance(cmd, LoRACommand):
            self.lora_command(cmd)
        elif isinstance(cmd, ReportState):
            self._state_asked = self._commands_since_message = True
        elif isinstance(cmd, (Sleep, WakeUp, UpdateWeights)):
            self.submit(cmd)
        elif isinstance(cmd, Shutdown):
            return False
        return True

    def submit(self, cmd: Sleep | WakeUp | UpdateWeights) -> None:
        """Queue a model command: it runs once no request is in the engine (the next ``step`` if none is);
        its ``CommandReply`` comes in a step message. An update that aborts requests ends every request
        in flight now, each with an error saying why."""
        self._commands_since_message = True
        if isinstance(cmd, UpdateWeights) and cmd.abort_all_requests:
            s, held = self.engine.scheduler, self.model_ops.held
            ids = [r.request_id for r in (*s.running, *s.waiting)] + list(self._compiling) + [a.request_id for a in held]
            self.abort(ids)
            for rid in ids:
                self._reject(rid, ServiceUnavailableError("the request was aborted: the model's weights are being "
                                                          "updated (update_weights_from_disk)", code="weights_updated"))
        self.model_ops.pending.append(cmd)

    def add(self, cmd: AddRequest) -> None:
        """Queue a request. A user error (a bad prompt, an invalid grammar) is reported in the next
        step message as a RequestRejected, never raised."""
        self._commands_since_message = True
        if self.model_ops.pending:  # behind a sleep or a weight update: it waits for the command
            self.model_ops.held.append(cmd)
            return
        if self.model_ops.sleeping:
            self._reject(cmd.request_id, ServiceUnavailableError(SLEEPING, code="sleeping"))
            return
        if cmd.trace:
            self._traced.add(cmd.request_id)
        if cmd.params.kv_transfer is not None:
            self._handoff(cmd)
            return
        if cmd.params.guided is None:
            self._admit(cmd)
            return
        try:
            self._compiling[cmd.request_id] = (cmd, self.engine.grammars.submit(cmd.params.guided))
        except KVServeError as e:
            self._reject(cmd.request_id, e)

    def _handoff(self, cmd: AddRequest) -> None:
        """A request with ``kv_transfer_params``: a prefill to send, or a decode to park until its KV is in."""
        t = cmd.params.kv_transfer
        assert t is not None
        if self.handoff is None:
            self._reject(cmd.request_id, InvalidArgumentError(
                "kv_transfer_params: this replica has no KV connector (start it with --role prefill or decode)",
                param="kv_transfer_params"))
            return
        if not t.receives:
            self._admit(cmd)
            if cmd.request_id in self._sent:
                self.handoff.start_send(cmd.request_id, cmd.prompt_token_ids, t)
            return
        try:
            req = self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                          output_token_ids=t.first_token_ids, queue=False)
        except KVServeError as e:
            self._reject(cmd.request_id, e)
            return
        req.scheduled_time = req.first_token_time = self.engine.clock()
        self._early.append(self._delta(req))
        if not req.is_finished:
            self.handoff.park(req, t)

    def abort(self, request_ids: list[str]) -> None:
        self._commands_since_message = True
        gone = set(request_ids)
        self.model_ops.held = [a for a in self.model_ops.held if a.request_id not in gone]
        for rid in request_ids:
            if self.handoff is not None and self.handoff.cancel(rid):
                self._sent.pop(rid, None)
                self._traced.discard(rid)
                continue
            if self._compiling.pop(rid, None) is None:
                self.engine.abort(rid)
            self._sent.pop(rid, None)
            self._traced.discard(rid)

    def lora_command(self, cmd: LoRACommand) -> CommandReply:
        """Load or unload an adapter now; the reply also goes out in the next step message."""
        self._commands_since_message = True
        error: KVServeError | None = None
        try:
            if self.lora is None:
                raise NotFoundError("LoRA adapters are off: start the server with --enable-lora")
            if cmd.action == "load":
                self.lora.load(cmd.name, str(cmd.path))
            else:
                self.lora.unload(cmd.name)
        except KVServeError as e:  # a 404 if what it names is missing, else a 400, about the adapter's name
            error = (NotFoundError if isinstance(e, NotFoundError) else InvalidArgumentError)(str(e), param="lora_name")
        reply = CommandReply(cmd.command_id, error, {"adapters": [] if self.lora is None else self.lora.names})
        self._replies.append(reply)
        return reply

    def wait_for_grammars(self, timeout: float) -> None:
        """Block until a pending grammar compile ends (or ``timeout``): for callers with nothing else to do."""
        if self._compiling:
            wait([f for _, f in self._compiling.values()], timeout, return_when=FIRST_COMPLETED)

    def _admit(self, cmd: AddRequest, compiled: Future | None = None) -> None:
        try:
            grammar = compiled.result() if compiled is not None else None
            lora = None
            if cmd.lora_name is not None:
                if self.lora is None:
                    raise NotFoundError(f"the model {cmd.lora_name!r} does not exist", param="model")
                lora = self.lora.resolve(cmd.lora_name)
                self.lora.prefetch(lora)
            self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, grammar, lora)
            self._sent[cmd.request_id] = 0
        except Exception as e:  # noqa: BLE001 - a bad request is rejected, never the engine's end
            if not isinstance(e, KVServeError):
                log.exception("request %s could not be added", cmd.request_id)
            self._reject(cmd.request_id, e)

    def _reject(self, request_id: str, e: Exception) -> None:
        self._traced.discard(request_id)
        self._rejected.append(RequestRejected(request_id, str(e), getattr(e, "param", None), getattr(e, "code", None)))

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> StepMessage | None:
        """Admit requests whose grammar is ready, run one step if there is work, and return what
        changed (None when nothing did and no command came in since the last message)."""
        for rid, (cmd, fut) in list(self._compiling.items()):
            if fut.done():
                del self._compiling[rid]
                self._admit(cmd, fut)
        if self.model_ops.pending and not self.engine.has_unfinished() and not self._compiling:
            replies, held_back = self.model_ops.run_pending()
            self._replies += replies
            for held in held_back:
                self.add(held)
        if self.handoff is not None:
            for req in self.handoff.ready():
                self.engine.scheduler.add(req)
        changed = self.engine.step() if self.engine.has_unfinished() else []
        if self.handoff is not None:
            self.handoff.after_step()
        step_end = time.monotonic()
        # (a prefill chunk that samples nothing still caches blocks: that is news too)
        stored, removed = self.engine.kv.take_events()
        if not (changed or self._rejected or self._early or self._commands_since_message or stored or removed
                or self._replies):
            return None
        replies, self._replies = self._replies, []
        deltas, self._early = self._early + [self._delta(req) for req in changed], []
        rejected, self._rejected, self._commands_since_message = self._rejected, [], False
        state = self.live_state() if self._state_asked else None
        self._state_asked = False
        return StepMessage(deltas, rejected, self.snapshot(), step_end, stored, removed, state, replies)

    def live_state(self) -> EngineState:
        now = time.monotonic()
        if self._tree is not None and now - self._tree[0] < self.tree_interval_s:
            return capture_state(self.engine, tree=self._tree[1])
        state = capture_state(self.engine)
        self._tree = (now, state.prefix_tree)
        return state

    def _delta(self, req: Request) -> RequestDelta:
        done = self._sent.get(req.request_id, 0)
        new = req.token_ids[req.num_prompt_tokens + done :]
        logprobs = req.logprobs[done:] if req.params.logprobs is not None else []
        if req.is_finished:
            self._sent.pop(req.request_id, None)
        else:
            self._sent[req.request_id] = done + len(new)
        prompt_logprobs = req.prompt_logprobs if done == 0 and req.params.prompt_logprobs is not None else None
        timeline = None
        if done == 0 and req.request_id in self._traced:
            self._traced.discard(req.request_id)
            timeline = RequestTimeline(req.arrival_time, req.scheduled_time, req.first_token_time, req.restored_blocks)
        return RequestDelta(req.request_id, new, logprobs, req.is_finished,
                            req.finish_reason.value if req.finish_reason else None, req.stop_reason,
                            req.num_prompt_tokens, req.num_cached_tokens,
                            (req.spec.num_verifies, req.spec.num_draft_tokens, req.spec.num_accepted_tokens),
                            prompt_logprobs, timeline)

    def snapshot(self) -> EngineStatsSnapshot:
        e, s = self.engine, self.engine.scheduler
        return EngineStatsSnapshot(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_blocks_used=e.kv.pool.num_blocks - e.kv.num_available_blocks,
            kv_blocks_total=e.kv.pool.num_blocks,
            kv_bytes_per_token=kv_bytes_per_token(e.runner),
            num_preemptions=s.stats.num_preemptions,
            prompt_tokens=e.stats.prompt_tokens,
            generation_tokens=e.stats.generation_tokens,
            kv_blocks_cached=e.kv.num_cached_blocks,
            # copies (the engine keeps counting), field by field: deepcopy cost ~0.2 ms a step
            prefix_cache=replace(e.kv.stats, tier_hits=dict(e.kv.stats.tier_hits)),
            spec=replace(s.stats.spec, accepted_length_counts=list(s.stats.spec.accepted_length_counts)),
            grammar=e.grammar_stats(),
            resident_memory_bytes=resident_memory_bytes(),
        )


def kv_bytes_per_token(runner: object) -> int:
    """Device bytes of one token's K and V as the runner's KV cache stores them (0: a runner that
    does not say, such as a test's stand-in)."""
    return getattr(runner, "kv_bytes_per_token", 0)
