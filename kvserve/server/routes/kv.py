"""``GET /kv/events``: what this replica's prefix cache stored and removed, and its load, for a router;
``GET /kv/transfer``: its role in disaggregated prefill, and where prefill replicas send it KV.

``since=N`` asks for the changes after sequence number N (``epoch``: of the run the reader last
saw); without it, or when N is too old for the log, from another epoch or ahead of it, the answer
is the whole set of cached block hashes with ``reset: true``. ``wait=S`` holds the answer up to S
seconds (at most ``MAX_WAIT_S``) until there is something new: a reader can long-poll. Hashes are
hex; ``hash_scheme`` says how to compute them from token ids (kvserve/server/kv_events.py).
With ``--api-key``, both routes need the key too: whether a prompt is cached says something about
other users' prompts, and the connector address is where KV is handed over (its TCP stream checks the
key as well, ``kvserve.kv.tcp_connector``).
"""

from __future__ import annotations

import hmac
import socket
import uuid
from typing import Any

from fastapi import APIRouter, Request

from kvserve.errors import AuthenticationError
from kvserve.server.state import State

router = APIRouter()

MAX_WAIT_S = 10.0  # a long poll never holds a graceful shutdown longer than this
_DEFAULT_ID = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


def replica_id(state: Any) -> str:
    return state.config.replica_id or f"{_DEFAULT_ID}:{state.config.port}"


def check_api_key(request: Request, state: State) -> None:
    """With ``--api-key``, a 401 unless the request carries it (read per request, as the config may change)."""
    key = state.config.api_key
    if key is not None:
        scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise AuthenticationError("missing or wrong API key")


@router.get("/kv/events")
async def kv_events(request: Request, state: State, since: int | None = None, epoch: str | None = None,
                    wait: float = 0.0) -> dict[str, Any]:
    check_api_key(request, state)
    log = state.client.kv_events
    if since is not None and (epoch is None or epoch == log.epoch):
        await log.wait_after(since, min(wait, MAX_WAIT_S) if wait > 0 else 0.0)  # (NaN: no wait)
    batch = log.since(since, epoch)
    stats = state.client.stats
    return {
        "replica_id": replica_id(state),
        "epoch": log.epoch,
        "enabled": log.enabled,
        "block_size": log.block_size,
        "hash_scheme": log.hash_scheme(),
        "seq": batch.seq,
        "reset": batch.reset,
        "stored": [k.hex() for k in batch.stored],
        "removed": [k.hex() for k in batch.removed],
        "num_cached_blocks": len(log.cached),
        "lora_adapters": state.adapters,  # a router sends an adapter's requests where it is loaded
        "load": {
            "running": stats.num_running,
            # requests this server holds that the engine does not run yet (some may be on their way to it)
            "waiting": max(stats.num_waiting, state.client.num_in_flight - stats.num_running),
            "kv_usage": stats.kv_cache_usage,
        },
    }


@router.get("/kv/transfer")
async def kv_transfer(request: Request, state: State) -> dict[str, Any]:
    check_api_key(request, state)
    cache = state.client.config.cache
    return {"role": cache.role, "connector": cache.kv_connector,
            "address": getattr(state.client, "kv_transfer_address", "")}
