"""The model's admin routes: SGLang's ``POST /update_weights_from_disk`` and vLLM's sleep mode
(``POST /sleep?level=1|2``, ``POST /wake_up``, ``GET /is_sleeping``).

Each waits for the requests in flight to finish, then runs in the engine between two steps
(kvserve.engine.model_ops); an update may abort them instead (``abort_all_requests``, SGLang's field).
While the model sleeps, generation requests get a 503 (code "sleeping"); during an update or a wake-up
they wait. Checkpoint paths are confined to ``--weights-dir``; without it, updates are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query

from kvserve.errors import InvalidArgumentError
from kvserve.server import protocol as P
from kvserve.server.state import State

router = APIRouter()


def confined_path(path: str, root: str | None) -> str:
    """``path`` (absolute, or relative to ``root``) resolved, symbolic links followed, if it lies in ``root``."""
    if root is None:
        raise InvalidArgumentError("weight updates are off on this server: start it with --weights-dir DIR to load "
                                   "checkpoints from DIR", param="model_path")
    base = Path(root).resolve()
    target = (base / path).resolve()
    if not target.is_relative_to(base):
        raise InvalidArgumentError(f"model_path must lie in the server's --weights-dir ({root})", param="model_path")
    return str(target)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: P.UpdateWeightsRequest, state: State) -> dict[str, Any]:
    path = confined_path(body.model_path, state.config.weights_dir)
    data = await state.client.update_weights(path, body.load_format or "auto", body.abort_all_requests)
    return {"success": True, "message": f"serving the weights of {body.model_path}", "model_path": body.model_path,
            "seconds": round(data["seconds"], 3)}


@router.post("/sleep")
async def sleep(state: State, level: int = Query(1, ge=1, le=2)) -> dict[str, Any]:
    data = await state.client.sleep(level)
    return {"is_sleeping": True, "level": data["sleep_level"], "seconds": round(data["seconds"], 3)}


@router.post("/wake_up")
async def wake_up(state: State) -> dict[str, Any]:
    data = await state.client.wake_up()
    return {"is_sleeping": False, "seconds": round(data["seconds"], 3)}


@router.get("/is_sleeping")
async def is_sleeping(state: State) -> dict[str, bool]:
    return {"is_sleeping": state.client.sleep_level > 0}
