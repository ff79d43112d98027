"""One kvserve replica as a Ray Serve deployment replica (``KVServeReplica``).

A replica is kvserve's own server: the FastAPI app (``kvserve.server.app``) over an engine process
(``AsyncEngineClient``), built from one ``KVServeConfig``; nothing of the scheduling or the API is
redone here. The ingress hands it whole HTTP requests (``ReplicaCall``), which it runs on the app
in-process (``run_on_app``) and streams back, naming itself in an ``x-kvserve-replica`` header. For the request router it reports, in its routing
stats, the chain hashes its prefix cache holds (the set ``GET /kv/events`` serves);
for Ray Serve's health checks, whether its engine process is alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any

from ray import serve

from kvserve.config import KVServeConfig
from kvserve.errors import EngineDeadError
from kvserve.ray_serve.call import ReplicaCall, ResponseStart, run_on_app
from kvserve.ray_serve.request_router import STATS_KEY

log = logging.getLogger("kvserve.ray_serve")

REPLICA_HEADER = b"x-kvserve-replica"  # which replica answered (Ray Serve's replica id), on every answer


class KVServeReplica:
    """kvserve's server over its engine process, reached through a Ray Serve deployment handle."""

    async def __init__(self, config: KVServeConfig):
        from kvserve.server.app import create_app
        from kvserve.server.engine_client import AsyncEngineClient

        # loading the model blocks: off the replica's event loop, so Ray's control calls still answer
        self.client = await asyncio.to_thread(AsyncEngineClient, config)
        self.app = create_app(self.client, config.server)
        # the app's lifespan attaches the engine client to this loop (and stops it on the way out)
        self._lifespan: AbstractAsyncContextManager[Any] | None = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        self.name = serve.get_replica_context().replica_id.unique_id.encode()

    async def handle(self, call: ReplicaCall) -> AsyncIterator[ResponseStart | bytes]:
        """Run one HTTP request on kvserve's app: its ``ResponseStart``, then its body as it comes."""
        async with contextlib.aclosing(run_on_app(self.app, call)) as answer:  # closed early: the app sees a disconnect
            async for item in answer:
                if isinstance(item, ResponseStart):
                    item.headers.append((REPLICA_HEADER, self.name))
                yield item

    async def admin(self, call: ReplicaCall) -> dict[str, Any]:
        """Run one of the admin routes the ingress sends to every replica (``DeploymentHandle.broadcast``)
        whole: ``{"replica", "status_code", "body"}``, as ``kvserve.router.fanout.summarize`` reads them."""
        status, chunks = 500, []
        async for item in run_on_app(self.app, call):
            if isinstance(item, ResponseStart):
                status = item.status
            else:
                chunks.append(item)
        body = b"".join(chunks)
        try:
            parsed: Any = json.loads(body)
        except ValueError:
            parsed = body.decode("utf-8", "replace")
        return {"replica": self.name.decode(), "status_code": status, "body": parsed}

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the request router routes by (``CacheAwareRequestRouter``)."""
        return {STATS_KEY: cache_stats(self.client)}

    async def check_health(self) -> None:
        if not self.client.is_alive:
            raise EngineDeadError("the engine process of this replica is gone")

    async def __del__(self) -> None:
        lifespan, self._lifespan = getattr(self, "_lifespan", None), None
        if lifespan is not None:
            await lifespan.__aexit__(None, None, None)  # stops the engine process


def cache_stats(client: Any) -> dict[str, Any]:
    """An engine client's prefix cache, as ``CacheAwareRequestRouter`` reads it. (No load: the router has
    Ray's own count, and stats that change only with the cache are pushed only when it changes.)"""
    events = client.kv_events
    return {"hash_scheme": events.hash_scheme() if events.enabled else None,
            "cached": b"".join(sorted(events.cached)),  # 16 bytes a block, sorted: equal sets compare equal
            "lora_adapters": sorted(getattr(client, "lora_adapters", None) or [])}
