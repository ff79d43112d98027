"""The engine loop in its own process, and the asyncio client the HTTP server talks to.

Layout (two processes, one engine loop):

    API process (asyncio)                              engine process (spawned)
    AsyncEngineClient.add_request ── AddRequest ──►    drain commands, Engine.step()
      RequestStream (per request)  ◄── StepMessage ──  one message per step: per-request
      OutputProcessor: detokenize,                     deltas (new token ids, logprobs,
      stop strings → AbortRequests                     finish) + a stats snapshot

Commands go through a ``multiprocessing.Queue`` (its feeder thread means ``put`` never blocks
the event loop); step messages go through a one-way ``Pipe`` written by the engine's own thread,
so nothing sits between the end of a step and the bytes leaving the process. The API process's
event loop watches the pipe's file descriptor itself (``add_reader``): no reader thread, so no
thread switch or GIL hand-over between a message arriving and its dispatch. Text lives only in the API
process: the engine works on token ids, so tokenizing and detokenizing never delay a step.

The engine process ignores SIGINT/SIGTERM: the API process decides when it stops (graceful
shutdown lets in-flight requests finish first) and it exits by itself if its parent dies.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import time
import traceback
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvserve.engine.engine import check_prompt
from kvserve.text.output import OutputProcessor, RequestOutput
from kvserve.engine.request import FinishReason, Request, SamplingParams, TokenLogprobs
from kvserve.errors import EngineDeadError, InvalidArgumentError, KVServeError, ModelLoadError, ServerBusyError
from kvserve.engine.scheduler import SpecStats
from kvserve.kv.manager import PrefixCacheStats

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from kvserve.config import EngineConfig
    from kvserve.engine.engine import Engine
    from kvserve.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

IDLE_POLL_S = 1.0  # an idle engine wakes this often to notice that its parent died
COMPILE_POLL_S = 0.002  # while grammars compile and nothing runs, how often to look for them


# --------------------------------------------------------------------------- messages


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


@dataclass
class EngineReady:
    """The engine's first message: what the API process must know to validate requests."""

    model_name: str
    max_model_len: int
    vocab_size: int | None
    num_kv_blocks: int
    block_size: int
    resident_memory_bytes: int | None = None


@dataclass
class EngineFailed:
    """The engine could not start, or a step raised: the process exits after sending this."""

    message: str
    user_error: bool  # a KVServeError (e.g. the model could not be loaded) rather than a bug


@dataclass
class RequestDelta:
    """What one step did to one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    spec: tuple[int, int, int] = (0, 0, 0)  # verifies, draft tokens, accepted tokens (so far)


@dataclass
class RequestRejected:
    """``Engine.add_request`` raised a user error for this request."""

    request_id: str
    message: str
    param: str | None
    code: str | None


@dataclass
class EngineStatsSnapshot:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0  # prefill tokens computed (recomputation after preemption included)
    generation_tokens: int = 0
    kv_blocks_cached: int = 0  # blocks held by the prefix cache
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    spec: SpecStats = field(default_factory=SpecStats)
    grammar: Any = None  # kvserve.structured.CacheStats once a grammar was asked for
    resident_memory_bytes: int | None = None  # the engine process's RSS (Linux only)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass
class StepMessage:
    deltas: list[RequestDelta]
    rejected: list[RequestRejected]
    stats: EngineStatsSnapshot
    step_end: float  # time.monotonic() in the engine process (CLOCK_MONOTONIC is system-wide)


# --------------------------------------------------------------------------- the engine process


def run_engine_process(config: EngineConfig, commands: mp.Queue, outputs: Connection) -> None:
    """Entry point of the engine process: load, report ready, then loop until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    try:
        engine, name = _build(config)
        outputs.send(EngineReady(name, engine.max_model_len, engine.vocab_size, engine.kv.pool.num_blocks,
                                 engine.kv.block_size, resident_memory_bytes()))
    except BaseException as e:  # noqa: BLE001 - anything that stops start-up goes back to the parent
        _send_failure(outputs, e)
        return
    try:
        _loop(engine, commands, outputs)
    except (BrokenPipeError, EOFError):
        pass  # the API process is gone
    except BaseException as e:  # noqa: BLE001
        _send_failure(outputs, e)
        raise SystemExit(1) from e


def _build(config: EngineConfig) -> tuple[Engine, str]:
    from kvserve.llm import build_engine
    from kvserve.model.loader import load_model, resolve_model_path
    from kvserve.text.tokenizer import Tokenizer

    loaded = load_model(resolve_model_path(config.model))
    eos = Tokenizer(loaded.tokenizer, loaded.config).eos_token_ids
    engine = build_engine(config, loaded.config, loaded.weights, eos, hf_tokenizer=loaded.tokenizer)
    return engine, loaded.name


def _send_failure(outputs: Connection, e: BaseException) -> None:
    user = isinstance(e, KVServeError)
    message = str(e) if user else "".join(traceback.format_exception(e)).rstrip()
    try:
        outputs.send(EngineFailed(message, user))
    except OSError:
        pass


def _parent_alive() -> bool:
    parent = mp.parent_process()
    return parent is None or parent.is_alive()


def _loop(engine: Engine, commands: mp.Queue, outputs: Connection) -> None:
    sent: dict[str, int] = {}  # output tokens already sent, per request
    # requests whose grammar compiles on the compile cache's threads, off this loop
    compiling: dict[str, tuple[AddRequest, Future]] = {}
    while True:
        cmds: list[Any] = []
        if not engine.has_unfinished():
            try:  # idle: sleep on the queue (briefly while grammars compile), never spin
                cmds.append(pickle.loads(commands.get(timeout=COMPILE_POLL_S if compiling else IDLE_POLL_S)))
            except queue.Empty:
                if not _parent_alive():
                    return
                if not compiling:
                    continue
        while True:
            try:
                cmds.append(pickle.loads(commands.get_nowait()))
            except queue.Empty:
                break

        rejected: list[RequestRejected] = []

        def add(cmd: AddRequest, compiled: Future | None = None) -> None:
            try:
                grammar = compiled.result() if compiled is not None else None
                engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, grammar)
                sent[cmd.request_id] = 0
            except Exception as e:  # noqa: BLE001 - a bad request is rejected, never the engine's end
                if not isinstance(e, KVServeError):
                    log.exception("request %s could not be added", cmd.request_id)
                rejected.append(RequestRejected(cmd.request_id, str(e), getattr(e, "param", None),
                                                getattr(e, "code", None)))

        for cmd in cmds:
            if isinstance(cmd, AddRequest):
                if cmd.params.guided is not None:
                    try:
                        compiling[cmd.request_id] = (cmd, engine.grammars.submit(cmd.params.guided))
                    except KVServeError as e:
                        rejected.append(RequestRejected(cmd.request_id, str(e), getattr(e, "param", None), None))
                else:
                    add(cmd)
            elif isinstance(cmd, AbortRequests):
                for rid in cmd.request_ids:
                    if compiling.pop(rid, None) is None:
                        engine.abort(rid)
                    sent.pop(rid, None)
            elif isinstance(cmd, Shutdown):
                return
        for rid, (cmd, fut) in list(compiling.items()):
            if fut.done():
                del compiling[rid]
                add(cmd, fut)

        changed = engine.step() if engine.has_unfinished() else []
        step_end = time.monotonic()
        if changed or cmds or rejected:
            deltas = [_delta(req, sent) for req in changed]
            outputs.send(StepMessage(deltas, rejected, _snapshot(engine), step_end))


def _delta(req: Request, sent: dict[str, int]) -> RequestDelta:
    done = sent.get(req.request_id, 0)
    new = req.token_ids[req.num_prompt_tokens + done :]
    logprobs = req.logprobs[done:] if req.params.logprobs is not None else []
    if req.is_finished:
        sent.pop(req.request_id, None)
    else:
        sent[req.request_id] = done + len(new)
    return RequestDelta(req.request_id, new, logprobs, req.is_finished,
                        req.finish_reason.value if req.finish_reason else None, req.stop_reason,
                        req.num_prompt_tokens, req.num_cached_tokens,
                        (req.spec.num_verifies, req.spec.num_draft_tokens, req.spec.num_accepted_tokens))


def _snapshot(engine: Engine) -> EngineStatsSnapshot:
    s = engine.scheduler
    return EngineStatsSnapshot(
        num_running=s.num_running,
        num_waiting=s.num_waiting,
        kv_blocks_used=engine.kv.pool.num_blocks - engine.kv.num_available_blocks,
        kv_blocks_total=engine.kv.pool.num_blocks,
        num_preemptions=s.stats.num_preemptions,
        prompt_tokens=engine.stats.prompt_tokens,
        generation_tokens=engine.stats.generation_tokens,
        kv_blocks_cached=engine.kv.num_cached_blocks,
        prefix_cache=copy.deepcopy(engine.kv.stats),
        spec=copy.deepcopy(s.stats.spec),
        grammar=engine.grammar_stats(),
        resident_memory_bytes=resident_memory_bytes(),
    )


_statm: tuple[int, int] | None = None  # (pid, fd of its /proc/self/statm): one pread per snapshot


def resident_memory_bytes() -> int | None:
    """This process's resident set size from /proc/self/statm; None where there is no /proc (not Linux)."""
    global _statm
    try:
        if _statm is None or _statm[0] != os.getpid():  # a forked child reopens its own
            _statm = (os.getpid(), os.open("/proc/self/statm", os.O_RDONLY))
        return int(os.pread(_statm[1], 128, 0).split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


# --------------------------------------------------------------------------- the API-process side


class RequestObserver(Protocol):
    """What the client reports per request (the server's metrics implement it)."""

    def on_handoff(self, seconds: float) -> None: ...
    def on_first_token(self, ttft: float, num_prompt_tokens: int, num_cached_tokens: int) -> None: ...
    def on_tokens(self, inter_token_latency: float, num_tokens: int) -> None: ...
    def on_finish(self, finish_reason: str, e2e_latency: float) -> None: ...


class RequestStream:
    """One engine request seen from the API process: an async iterator of RequestOutputs.

    Each ``__anext__`` takes every delta that arrived since the last one, so a consumer
    that falls behind gets its tokens in a group rather than one chunk per token.
    """

    def __init__(self, client: AsyncEngineClient, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float):
        self.client = client
        self.request_id = request_id
        self.params = params
        self.arrival_time = arrival_time
        # (engine step end time, delta), or the error that ends the request
        self.queue: asyncio.Queue[tuple[float, RequestDelta] | BaseException] = asyncio.Queue()
        # A mirror of the engine's Request: the OutputProcessor reads it as it would in-process.
        self.mirror = Request(request_id, prompt_token_ids, params, max_total_tokens=client.max_model_len)
        self.finished = False
        self._last_token_time: float | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        try:
            return self._apply(items)
        except BaseException:
            self.finished = True
            self.client._forget(self.request_id)
            raise

    def _apply(self, items: list[tuple[float, RequestDelta] | BaseException]) -> RequestOutput:
        now = time.monotonic()
        obs = self.client.observer
        m = self.mirror
        num_new = 0
        for item in items:
            if isinstance(item, BaseException):
                raise item
            step_end, item = item
            if obs is not None:
                obs.on_handoff(now - step_end)
            m.token_ids.extend(item.new_token_ids)
            m.logprobs.extend(item.new_logprobs)
            m.num_cached_tokens = item.num_cached_tokens
            m.spec.num_verifies, m.spec.num_draft_tokens, m.spec.num_accepted_tokens = item.spec
            num_new += len(item.new_token_ids)
            if item.finished:
                m.finish(FinishReason(item.finish_reason), item.stop_reason)
        out, stopped = self.client.processor.process(m)
        if stopped:  # a stop string ended it here; the engine still thinks it runs
            self.client._send(AbortRequests([self.request_id]))
        if obs is not None and num_new:
            if self._last_token_time is None:
                obs.on_first_token(now - self.arrival_time, m.num_prompt_tokens, m.num_cached_tokens)
            else:
                obs.on_tokens((now - self._last_token_time) / num_new, num_new)
        if num_new:
            self._last_token_time = now
        if out.finished:
            self.finished = True
            self.client._forget(self.request_id)
            if obs is not None:
                obs.on_finish(out.finish_reason or "stop", now - self.arrival_time)
        return out

    def abort(self) -> None:
        """Stop the request now (client went away); a no-op once it finished."""
        if not self.finished:
            self.finished = True
            self.client.abort(self.request_id)
            if self.client.observer is not None:
                self.client.observer.on_finish(FinishReason.ABORT.value, time.monotonic() - self.arrival_time)


class AsyncEngineClient:
    """Starts the engine process and multiplexes requests over it for one asyncio loop.

    Construction blocks until the engine has loaded the model (or raises its error);
    ``attach`` must then run on the serving event loop before ``add_request`` is used.
    """

    def __init__(self, config: EngineConfig, *, tokenizer: Tokenizer | None = None,
                 max_waiting_requests: int | None = None, startup_timeout: float = 600.0):
        self.config = config
        self.max_waiting_requests = max_waiting_requests
        self.observer: RequestObserver | None = None
        self.stats = EngineStatsSnapshot()
        self._requests: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading = False
        self._dead: str | None = None  # why the engine is unusable
        self._closing = False

        ctx = mp.get_context("spawn")
        self._commands: mp.Queue = ctx.Queue()
        self._outputs, child_end = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=run_engine_process, args=(config, self._commands, child_end),
                                 name="kvserve-engine", daemon=True)
        self._proc.start()
        child_end.close()  # so that the engine's death reads as EOF here
        try:
            # The engine process starts first: these imports (torch among them) and the tokenizer
            # load overlap with its own start-up.
            from kvserve.model.loader import load_tokenizer, resolve_model_path
            from kvserve.text.tokenizer import Tokenizer

            self.tokenizer = tokenizer or Tokenizer(load_tokenizer(resolve_model_path(config.model)))
            ready = self._wait_ready(startup_timeout)
        except BaseException:
            self._kill()
            raise
        self.model_name = ready.model_name
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.stats = EngineStatsSnapshot(kv_blocks_total=ready.num_kv_blocks,
                                         resident_memory_bytes=ready.resident_memory_bytes)
        self.processor = OutputProcessor(self.tokenizer)

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
                    validate: bool = True) -> RequestStream:
        """Queue a request in the engine and return the stream of its outputs.

        Validation happens here, so a bad request never reaches the engine; ``validate=False``
        exists for tests of the engine's own checks.
        """
        self._check_alive()
        if self._loop is None:
            raise RuntimeError("AsyncEngineClient.attach() was not called")
        if validate:
            self.validate_prompt(prompt_token_ids)
        rid = request_id or uuid.uuid4().hex
        stream = RequestStream(self, rid, list(prompt_token_ids), params, arrival_time or time.monotonic())
        self.processor.add(stream.mirror)
        self._requests[rid] = stream
        try:
            self._send(AddRequest(rid, list(prompt_token_ids), params))
        except BaseException:
            self._forget(rid)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        if self._forget(request_id) is not None and self.is_alive:
            self._send(AbortRequests([request_id]))

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
            for r in msg.rejected:
                stream = self._requests.get(r.request_id)
                if stream is not None:
                    stream.queue.put_nowait(InvalidArgumentError(r.message, param=r.param, code=r.code))
            for d in msg.deltas:
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
        self.stats = EngineStatsSnapshot(kv_blocks_total=self.stats.kv_blocks_total)

    def _fail_all(self, why: str) -> None:
        for stream in list(self._requests.values()):
            stream.queue.put_nowait(EngineDeadError(why))
        self._requests.clear()
