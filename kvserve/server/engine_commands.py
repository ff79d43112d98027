"""The engine client's commands: sleep, wake, weight updates and LoRA load/unload, sent to the engine
process and awaited until a step message brings their ``CommandReply`` (one type and one way to wait
for all of them; kvserve.engine.model_ops and ``EngineCore.lora_command`` run them).

The client refuses new requests (503) from the moment it sends a sleep, so none reaches a sleeping
engine; from the moment it sends a wake-up, new requests go to the engine again and wait there behind
it. After a weight update whose fingerprint changed, the KV event log starts a new epoch under the new
root key, so a router's hashes follow the new weights.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, Any

from kvserve.engine.messages import CommandReply, EngineCommand, LoRACommand, Sleep, UpdateWeights, WakeUp
from kvserve.engine.model_ops import SLEEPING
from kvserve.errors import ServiceUnavailableError

if TYPE_CHECKING:
    from kvserve.server.kv_events import KVEventLog


class EngineCommands:
    """Mixed into ``AsyncEngineClient``, which provides ``_send``, ``_check_alive``, ``_loop``, ``kv_events``
    and ``lora_adapters``."""

    kv_events: KVEventLog
    lora_adapters: list[str] | None
    _loop: asyncio.AbstractEventLoop | None

    def __init__(self) -> None:
        self._commands_pending: dict[str, asyncio.Future[CommandReply]] = {}  # sent, not answered yet
        self._sleep_level = 0  # of the sleep asked for; 0: awake (or waking)

    if TYPE_CHECKING:
        def _send(self, cmd: Any) -> None: ...
        def _check_alive(self) -> None: ...

    @property
    def sleep_level(self) -> int:
        """0 awake, else the level of the sleep asked for (new requests are refused from then on)."""
        return self._sleep_level

    async def sleep(self, level: int) -> dict[str, Any]:
        """Put the engine to sleep once the requests in flight finish (``level`` 1: the KV cache freed;
        2: the weights too); requests that arrive from now on get a 503 until ``wake_up``."""
        before, self._sleep_level = self._sleep_level, max(self._sleep_level, level)
        try:
            return await self._command(Sleep(uuid.uuid4().hex, level))
        except BaseException:
            self._sleep_level = before
            raise

    async def wake_up(self) -> dict[str, Any]:
        """Wake the engine; requests that arrive meanwhile wait for it in the engine."""
        before, self._sleep_level = self._sleep_level, 0
        try:
            return await self._command(WakeUp(uuid.uuid4().hex))
        except BaseException:
            self._sleep_level = before
            raise

    async def update_weights(self, model_path: str, load_format: str = "auto",
                             abort_all_requests: bool = False) -> dict[str, Any]:
        """Serve the checkpoint at ``model_path`` once the requests in flight finish (with
        ``abort_all_requests``: end them now, each with an error); requests that arrive meanwhile wait."""
        if self._sleep_level:
            raise ServiceUnavailableError(SLEEPING + " before its weights are updated", code="sleeping")
        data = await self._command(UpdateWeights(uuid.uuid4().hex, model_path, load_format, abort_all_requests))
        if data["cache_root_key"] != self.kv_events.root_key:
            self.kv_events.clear()
            self.kv_events.root_key = data["cache_root_key"]
        return data

    async def lora_command(self, action: str, name: str, path: str | None = None) -> dict[str, Any]:
        """Load (from ``path``) or unload an adapter in the engine, between two of its steps; raises its
        error (NotFoundError, InvalidArgumentError), else returns {"adapters": those loaded now}."""
        return await self._command(LoRACommand(uuid.uuid4().hex, action, name, path))

    async def _command(self, cmd: EngineCommand) -> dict[str, Any]:
        """Send ``cmd`` and wait for its reply: its data, or its error raised."""
        self._check_alive()
        if self._loop is None:
            raise RuntimeError("the engine client is not attached to an event loop")
        future = self._commands_pending[cmd.command_id] = self._loop.create_future()
        try:
            self._send(cmd)
            reply = await future
        finally:
            self._commands_pending.pop(cmd.command_id, None)
        if reply.error is not None:
            raise reply.error
        return reply.data

    def _answer_commands(self, replies: list[CommandReply]) -> None:
        for reply in replies:
            if "adapters" in reply.data:  # a LoRA command's, even a failed one: the adapters loaded now
                self.lora_adapters = reply.data["adapters"]
            future = self._commands_pending.pop(reply.command_id, None)
            if future is not None and not future.done():
                future.set_result(reply)

    def _fail_commands(self, error: BaseException) -> None:
        for future in self._commands_pending.values():
            if not future.done():
                future.set_exception(error)
        self._commands_pending.clear()
