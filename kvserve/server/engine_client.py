"""The API process's side of the engine: the ``EngineClient`` protocol and its multiprocessing client.

    API process (asyncio)                              engine process (spawned)
    AsyncEngineClient.add_request ── AddRequest ──►    kvserve.engine.worker around an EngineCore
      RequestStream (per request)  ◄── StepMessage ──  one message per step: per-request
      OutputProcessor: detokenize,                     deltas (new token ids, logprobs,
      stop strings → AbortRequests                     finish) + a stats snapshot

Commands go through a ``multiprocessing.Queue`` (its feeder thread means ``put`` never blocks
the event loop); step messages come back through a one-way ``Pipe``. The event loop watches
the pipe's file descriptor itself (``add_reader``): no reader thread, so no thread switch or GIL
hand-over between a message arriving and its dispatch. Text lives only in the API process: the
engine works on token ids, so tokenizing and detokenizing never delay a step.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import pickle
import time
import uuid
from typing import TYPE_CHECKING, Any, Protocol

from kvserve.config import KVServeConfig
from kvserve.engine.engine import check_prompt
from kvserve.engine.live_state import EngineState
from kvserve.engine.messages import (AbortRequests, AddRequest, EngineFailed, EngineReady, EngineStatsSnapshot,
                                     ReportState, Shutdown, StepMessage)
from kvserve.engine.model_ops import SLEEPING
from kvserve.text.output import OutputProcessor
from kvserve.engine.request import Request, SamplingParams
from kvserve.engine.worker import engine_environment, run_engine_process
from kvserve.errors import EngineDeadError, ModelLoadError, ServerBusyError, ServiceUnavailableError
from kvserve.server.kv_events import KVEventLog
from kvserve.server.engine_commands import EngineCommands
from kvserve.server.lora_metrics import LoRAUsage
from kvserve.server.request_stream import RequestObserver, RequestStream

if TYPE_CHECKING:
    from kvserve.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def _build_core(config: KVServeConfig) -> Any:
    """The engine process's start-up: load the model, build the core (torch is imported there only)."""
    from kvserve.build import build_engine_core

    return build_engine_core(config)


class EngineClient(Protocol):
    """What the server, its metrics (and a router or a Ray replica) need from an engine."""

    config: KVServeConfig
    model_name: str
    max_model_len: int
    vocab_size: int | None
    tokenizer: Tokenizer
    stats: EngineStatsSnapshot  # the engine's latest snapshot
    kv_events: KVEventLog  # what the prefix cache stored and removed (GET /kv/events)
    observer: RequestObserver | None

    @property
    def is_alive(self) -> bool: ...
    @property
    def num_in_flight(self) -> int: ...
    def attach(self) -> None: ...
    def shutdown(self, timeout: float = 10.0) -> None: ...
    def check_capacity(self, num_requests: int) -> None: ...
    def validate_prompt(self, prompt_token_ids: list[int]) -> None: ...
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, *, arrival_time: float | None = None,
                    request_id: str | None = None, validate: bool = True, trace: bool = False,
                    lora_name: str | None = None) -> RequestStream: ...
    def abort(self, request_id: str) -> None: ...
    async def fetch_state(self, timeout: float = 5.0) -> EngineState | None: ...
    @property
    def sleep_level(self) -> int: ...
    async def sleep(self, level: int) -> dict[str, Any]: ...
    async def wake_up(self) -> dict[str, Any]: ...
    async def update_weights(self, model_path: str, load_format: str = "auto",
                             abort_all_requests: bool = False) -> dict[str, Any]: ...


class AsyncEngineClient(EngineCommands):
    """Starts the engine process and multiplexes requests over it for one asyncio loop.

    Construction blocks until the engine has loaded the model (or raises its error);
    ``attach`` must then run on the serving event loop before ``add_request`` is used.
    """

    def __init__(self, config: KVServeConfig, *, tokenizer: Tokenizer | None = None, startup_timeout: float = 600.0):
        self.config = config
        self.max_waiting_requests = config.server.max_waiting_requests
        self.observer: RequestObserver | None = None
        self.stats = EngineStatsSnapshot()
        self._requests: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading = False
        self._dead: str | None = None  # why the engine is unusable
        self._closing = False
        self._state: asyncio.Future[EngineState | None] | None = None  # a ReportState's answer, pending
        EngineCommands.__init__(self)

        ctx = mp.get_context("spawn")
        self._commands: mp.Queue = ctx.Queue()
        self._outputs, child_end = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=run_engine_process, args=(_build_core, config, self._commands, child_end),
                                 name="kvserve-engine", daemon=True)
        with engine_environment():
            self._proc.start()
        child_end.close()  # so that the engine's death reads as EOF here
        try:
            # The engine process starts first: these imports (torch among them) and the tokenizer
            # load overlap with its own start-up.
            from kvserve.model.loader import load_tokenizer, resolve_model_path
            from kvserve.text.tokenizer import Tokenizer

            self.tokenizer = tokenizer or Tokenizer(load_tokenizer(resolve_model_path(config.model.model)))
            ready = self._wait_ready(startup_timeout)
        except BaseException:
            self._kill()
            raise
        self.model_name = ready.model_name
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.stats = EngineStatsSnapshot(kv_blocks_total=ready.num_kv_blocks, kv_bytes_per_token=ready.kv_bytes_per_token,
                                         resident_memory_bytes=ready.resident_memory_bytes)
        self.processor = OutputProcessor(self.tokenizer)
        self.kv_events = KVEventLog(ready.block_size, ready.cache_root_key, enabled=ready.prefix_caching)
        self.kv_transfer_address = ready.kv_transfer_address  # where prefill replicas send KV ("": nowhere)
        # the LoRA adapters loaded (None: --enable-lora is off), their requests and tokens
        self.lora_adapters = ready.lora_adapters
        self.lora_usage = LoRAUsage()

    def _wait_ready(self, timeout: float) -> EngineReady:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._outputs.poll(0.2):
                try:
                    msg = self._outputs.recv()
                except EOFError:
                    break
                if isinstance(msg, EngineReady):
                    return msg
                if isinstance(msg, EngineFailed):
                    if msg.user_error:
                        raise ModelLoadError(msg.message)
                    raise RuntimeError(f"the engine process failed to start:\n{msg.message}")
            elif not self._proc.is_alive():
                break
        else:
            raise RuntimeError(f"the engine process did not become ready within {timeout:.0f}s")
        self._proc.join(5)
        raise RuntimeError(f"the engine process exited during start-up (exit code {self._proc.exitcode})")

    # -- lifecycle ------------------------------------------------------------------------
    def attach(self) -> None:
        """Start delivering engine messages to the running event loop (call it on that loop)."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._outputs.fileno(), self._on_readable)
        self._reading = True

    def _stop_reading(self) -> None:
        if self._reading and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._outputs.fileno())
        self._reading = False

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._proc.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (requests still in it get EngineDeadError). Call it on the loop."""
        self._closing = True
        self._stop_reading()
        if self._proc.is_alive():
            self._send(Shutdown())
            self._proc.join(timeout)
        self._kill()
        self._outputs.close()
        self._commands.close()
        self._commands.join_thread()
        self._fail_all("the server is shutting down")
        self._fail_commands(EngineDeadError("the server is shutting down"))

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    # -- requests -------------------------------------------------------------------------
    def check_capacity(self, num_requests: int) -> None:
        """Raise ServerBusyError if ``num_requests`` more would overflow the waiting queue.

        The engine's last snapshot says how many requests run; every other request this client
        has in flight waits (or is about to: its add is still on the way).
        """
        self._check_alive()
        limit = self.max_waiting_requests
        if limit is None:
            return
        waiting = max(0, len(self._requests) - self.stats.num_running)
        if waiting + num_requests > limit:
            raise ServerBusyError(
                f"the server is busy: {waiting} requests are waiting (limit {limit}); retry later"
            )

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        check_prompt(prompt_token_ids, self.max_model_len, self.vocab_size)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, *,
                    arrival_time: float | None = None, request_id: str | None = None,
                    validate: bool = True, trace: bool = False, lora_name: str | None = None) -> RequestStream:
        """Queue a request in the engine and return the stream of its outputs.

        Validation happens here, so a bad request never reaches the engine; ``validate=False`` is for
        callers that already validated the prompt (the server checks all of a request's prompts
        before adding any) and for tests of the engine's own checks. ``trace``: the engine sends the
        request's timeline with its first output (``RequestDelta.timeline``), for a span. ``lora_name``: the
        adapter it runs with.
        """
        self._check_alive()
        if self._loop is None:
            raise RuntimeError("AsyncEngineClient.attach() was not called")
        if self._sleep_level:
            raise ServiceUnavailableError(SLEEPING, code="sleeping")
        if validate:
            self.validate_prompt(prompt_token_ids)
        rid = request_id or uuid.uuid4().hex
        stream = RequestStream(self, rid, arrival_time or time.monotonic())
        # the client's copy of the request, which the engine's deltas bring up to date
        self.processor.add(Request(rid, list(prompt_token_ids), params, max_total_tokens=self.max_model_len))
        self._requests[rid] = stream
        try:
            self._send(AddRequest(rid, list(prompt_token_ids), params, trace, lora_name))
            if lora_name is not None:
                self.lora_usage.start(rid, lora_name, len(prompt_token_ids))
        except BaseException:
            self._forget(rid)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        if self._forget(request_id) is not None:
            self._abort_in_engine(request_id)

    def _abort_in_engine(self, request_id: str) -> None:
        if self.is_alive:
            self._send(AbortRequests([request_id]))

    async def fetch_state(self, timeout: float = 5.0) -> EngineState | None:
        """The engine's live state (requests, blocks, prefix tree), built between two of its steps;
        None if the engine is gone or does not answer within ``timeout``. Callers at the same time
        share one ask."""
        if not self.is_alive or self._loop is None:
            return None
        if self._state is None or self._state.done():
            self._state = self._loop.create_future()
            self._send(ReportState())
        try:
            return await asyncio.wait_for(asyncio.shield(self._state), timeout)
        except TimeoutError:
            return None

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def _check_alive(self) -> None:
        if not self.is_alive:
            raise EngineDeadError(self._dead or "the engine process is not running")

    def _forget(self, request_id: str) -> RequestStream | None:
        self.processor.drop(request_id)
        return self._requests.pop(request_id, None)

    def _send(self, cmd: Any) -> None:
        # Pickled here, not by the queue's feeder thread: that thread drops what it cannot pickle
        # (a value nested past the recursion limit, say) and the request would wait forever.
        payload = pickle.dumps(cmd, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._commands.put(payload)
        except (ValueError, OSError):  # queue closed during shutdown
            pass

    # -- dispatch on the event loop ---------------------------------------------------------
    def _on_readable(self) -> None:
        # The engine writes each message whole, so a readable pipe holds at least one complete
        # message (or the EOF of a dead engine). One message per call: if more are waiting, the
        # (level-triggered) selector calls again on the next loop iteration.
        try:
            msg: Any = self._outputs.recv()
        except (EOFError, OSError):
            msg = None
        if msg is None or isinstance(msg, EngineFailed):
            self._stop_reading()
        self._dispatch(msg)

    def _dispatch(self, msg: StepMessage | EngineFailed | None) -> None:
        if isinstance(msg, StepMessage):
            self.stats = msg.stats
            self.kv_events.apply(msg.kv_stored, msg.kv_removed)
            if msg.state is not None and self._state is not None and not self._state.done():
                self._state.set_result(msg.state)
            self._answer_commands(msg.replies)
            for r in msg.rejected:
                stream = self._requests.get(r.request_id)
                if stream is not None:
                    stream.queue.put_nowait(r.error())
            for d in msg.deltas:
                self.lora_usage.on_delta(d)
                stream = self._requests.get(d.request_id)
                if stream is not None:  # else: aborted here after the engine stepped it
                    stream.queue.put_nowait((msg.step_end, d))
            return
        if self._closing:
            self._dead = "the server is shutting down"
        elif isinstance(msg, EngineFailed):
            log.error("the engine process failed:\n%s", msg.message)
            self._dead = "the engine process failed; the server must be restarted"
        else:
            log.error("the engine process exited unexpectedly (exit code %s)", self._proc.exitcode)
            self._dead = "the engine process exited unexpectedly; the server must be restarted"
        self._fail_all(self._dead)
        self._fail_commands(EngineDeadError(self._dead))
        if self._state is not None and not self._state.done():
            self._state.set_result(None)
        self.stats = EngineStatsSnapshot(kv_blocks_total=self.stats.kv_blocks_total,
                                         kv_bytes_per_token=self.stats.kv_bytes_per_token)
        self.kv_events.clear()

    def _fail_all(self, why: str) -> None:
        for stream in list(self._requests.values()):
            stream.queue.put_nowait(EngineDeadError(why))
        self._requests.clear()
