"""Operations routes: /health (503 once the engine is gone), /version, and Prometheus' /metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

import kvserve
from kvserve.errors import EngineDeadError
from kvserve.server.state import State

router = APIRouter()


@router.get("/health")
async def health(state: State) -> dict[str, str]:
    if not state.client.is_alive:
        raise EngineDeadError("the engine process is not running")
    return {"status": "ok"}


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": kvserve.__version__}


@router.get("/metrics")
async def metrics(state: State) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
