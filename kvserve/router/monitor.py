"""Watching the backends: health checks, and following each one's KV events (``Monitor``).

Per backend, two tasks on the router's event loop:
- health: ``GET /health`` every ``health_interval_s``. A refused connection takes the backend out
  at once; any other failure (a timeout, a 503 from a dead engine) after ``fail_after`` in a row. A
  backend that answers again comes back. The proxy reports refused connections too (``connect_failed``).
- events: ``GET /kv/events?since=SEQ&epoch=E&wait=W``, a long poll: the replica answers as soon as
  its cache changed (or after W seconds, with its load), and the answer is applied to the mirror in
  ``Backend``. The first answer (and any after an error) is a full snapshot.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

from kvserve.router.backends import Backend

log = logging.getLogger("kvserve.router")


@dataclass
class MonitorConfig:
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    fail_after: int = 2  # failed checks in a row that take a backend out
    events_wait_s: float = 1.0  # the long poll's wait (the replica caps it at 10 s)
    events_min_interval_s: float = 0.05  # at most ~20 polls a second per backend, however busy its cache


class Monitor:
    def __init__(self, client: httpx.AsyncClient, config: MonitorConfig | None = None):
        self.client = client
        self.config = config or MonitorConfig()
        self._tasks: dict[Backend, list[asyncio.Task]] = {}

    def watch(self, backend: Backend) -> None:
        """Start checking ``backend`` and following its events (on the running loop)."""
        if backend not in self._tasks:
            self._tasks[backend] = [asyncio.ensure_future(self._health_loop(backend)),
                                    asyncio.ensure_future(self._events_loop(backend))]

    async def unwatch(self, backend: Backend) -> None:
        tasks = self._tasks.pop(backend, [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        for backend in list(self._tasks):
            await self.unwatch(backend)

    # -- health -------------------------------------------------------------------------------
    def connect_failed(self, backend: Backend, why: BaseException | str) -> None:
        """Nothing listens at the backend's address: out at once."""
        backend.failures = max(backend.failures + 1, self.config.fail_after)
        self._mark_down(backend, why)

    def check_failed(self, backend: Backend, why: BaseException | str) -> None:
        backend.failures += 1
        if backend.failures >= self.config.fail_after:
            self._mark_down(backend, why)

    def _mark_down(self, backend: Backend, why: BaseException | str) -> None:
        if backend.healthy:
            log.warning("backend %s is down (%s): taken out of routing", backend.url, _describe(why))
        backend.healthy = False
        backend.forget_cache()  # a replica that comes back may be a new one, with an empty cache

    def check_passed(self, backend: Backend) -> None:
        backend.failures = 0
        if not backend.healthy:
            log.info("backend %s is up again: back in routing", backend.url)
            backend.healthy = True

    async def check(self, backend: Backend) -> None:
        """One health check."""
        try:
            r = await self.client.get(f"{backend.url}/health", timeout=self.config.health_timeout_s)
        except httpx.ConnectError as e:
            self.connect_failed(backend, e)
            return
        except httpx.HTTPError as e:
            self.check_failed(backend, e)
            return
        if r.status_code == 200:
            self.check_passed(backend)
        else:
            self.check_failed(backend, f"/health answered {r.status_code}")

    async def _health_loop(self, backend: Backend) -> None:
        while True:
            await self.check(backend)
            await asyncio.sleep(self.config.health_interval_s)

    # -- KV events ------------------------------------------------------------------------------
    async def poll_events(self, backend: Backend, wait_s: float = 0.0) -> None:
        """One ``GET /kv/events`` applied to the backend's mirror (a snapshot unless it is in step)."""
        params: dict[str, str | float] = {"wait": wait_s}
        if backend.synced and backend.seq is not None and backend.epoch is not None:
            params.update(since=backend.seq, epoch=backend.epoch)
        r = await self.client.get(f"{backend.url}/kv/events", params=params, timeout=wait_s + 10.0)
        r.raise_for_status()
        backend.apply_events(r.json())

    async def _events_loop(self, backend: Backend) -> None:
        cfg = self.config
        while True:
            if not backend.healthy:
                await asyncio.sleep(cfg.health_interval_s)
                continue
            try:
                await self.poll_events(backend, cfg.events_wait_s)
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                log.debug("KV events of %s: %s", backend.url, _describe(e))
                backend.forget_cache()
                await asyncio.sleep(max(cfg.health_interval_s / 2, cfg.events_min_interval_s))
                continue
            await asyncio.sleep(cfg.events_min_interval_s)


def _describe(why: BaseException | str) -> str:
    if isinstance(why, BaseException):
        return f"{type(why).__name__}: {why}" if str(why) else type(why).__name__
    return why

