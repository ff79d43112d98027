"""Sleep, wake and weight updates: what the engine does to its model between steps, with nothing running.

``ModelOps`` keeps the model commands (``Sleep``, ``WakeUp``, ``UpdateWeights``) that came in, in
order, and the requests added behind them, which wait (the core holds them back) until the commands
are done. The core runs the commands once no request is in the engine: requests in flight finish
first, on the weights they started with, unless an update asked to abort them. Then:
- ``Sleep``: the runner frees its KV tensors (level 2: its weights too) and the KV manager drops its
  prefix cache, whose blocks no longer hold anything; tier entries stay valid. While asleep, new
  requests are refused (``ServiceUnavailableError``, code "sleeping").
- ``WakeUp``: the runner makes its KV tensors again (level 2: reloads the weights from where they came).
- ``UpdateWeights``: the runner loads the checkpoint, refusing one that does not fit, and the KV
  manager drops the prefix cache and takes the new weights' fingerprint, so every tier entry computed
  by the old ones is a miss from then on.
The runner's side (``ModelLifecycle``) is the torch runner's; no torch here.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Protocol

from kvserve.engine.engine import Engine
from kvserve.engine.messages import AddRequest, CommandReply, ModelCommand, Sleep, UpdateWeights, WakeUp
from kvserve.errors import InvalidArgumentError, KVServeError, ServiceUnavailableError

log = logging.getLogger(__name__)

SLEEPING = "the model is asleep: wake it first (POST /wake_up; LLM.wake_up())"


class ModelLifecycle(Protocol):
    """What a runner does for these commands (kvserve.runner.torch_runner.TorchRunner)."""

    kv_fingerprint: bytes

    def sleep(self, level: int) -> None: ...
    def wake_up(self) -> None: ...
    def load_weights(self, model_path: str, load_format: str = "auto") -> None: ...


class ModelOps:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.pending: deque[ModelCommand] = deque()
        self.held: list[AddRequest] = []  # added behind a pending command: they wait for it
        self.sleep_level = 0  # 0: awake

    @property
    def sleeping(self) -> bool:
        return self.sleep_level > 0

    def run_pending(self) -> tuple[list[CommandReply], list[AddRequest]]:
        """Run the pending commands, in order (the caller saw the engine empty); returns their replies
        and the held requests, to add now."""
        replies = []
        while self.pending:
            replies.append(self.run(self.pending.popleft()))
        held, self.held = self.held, []
        return replies, held

    def run(self, cmd: ModelCommand) -> CommandReply:
        started = time.perf_counter()
        try:
            if isinstance(cmd, Sleep):
                self._sleep(cmd.level)
            elif isinstance(cmd, WakeUp):
                self._wake_up()
            else:
                self._update(cmd)
        except KVServeError as e:
            return CommandReply(cmd.command_id, e)
        except Exception as e:  # noqa: BLE001 - the engine goes on with what it had
            log.exception("%s failed", type(cmd).__name__)
            return CommandReply(cmd.command_id, KVServeError(f"{type(cmd).__name__} failed: {e}"))
        seconds = time.perf_counter() - started
        log.info("%s done in %.2f s", type(cmd).__name__, seconds)
        return CommandReply(cmd.command_id, data={"seconds": seconds, "sleep_level": self.sleep_level,
                                                   "cache_root_key": self.engine.kv.cache_root_key})

    def _runner(self) -> ModelLifecycle:
        runner: Any = self.engine.runner
        if not hasattr(runner, "load_weights"):
            raise InvalidArgumentError("this engine's runner cannot sleep or load weights")
        return runner

    def _sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise InvalidArgumentError(f"the sleep level must be 1 or 2, not {level}", param="level")
        if level <= self.sleep_level:
            return
        self._runner().sleep(level)
        self.engine.kv.reset()
        self.sleep_level = level

    def _wake_up(self) -> None:
        if not self.sleeping:
            return
        runner = self._runner()
        runner.wake_up()
        self.engine.kv.reset(runner.kv_fingerprint)  # reloaded (level 2): the files may have changed
        self.sleep_level = 0

    def _update(self, cmd: UpdateWeights) -> None:
        if self.sleeping:
            raise ServiceUnavailableError(SLEEPING + ": wake it before updating the weights", code="sleeping")
        runner = self._runner()
        runner.load_weights(cmd.model_path, cmd.load_format)
        self.engine.kv.reset(runner.kv_fingerprint)
