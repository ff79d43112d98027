"""Operations routes: /health (503 once the engine is gone; says whether the model sleeps), /version, and Prometheus' /metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

import kvserve
from kvserve.errors import EngineDeadError
from kvserve.server.state import State

router = APIRouter()


@router.get("/health")
async def health(state: State) -> dict[str, str | int]:
    """200 while the engine lives: {"status": "ok"}, or "sleeping" with its level (POST /sleep); 503 once it is gone."""
    if not state.client.is_alive:
        raise EngineDeadError("the engine process is not running")
    level = state.client.sleep_level
    return {"status": "sleeping", "sleep_level": level} if level else {"status": "ok"}


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": kvserve.__version__}


@router.get("/metrics")
async def metrics(state: State) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
