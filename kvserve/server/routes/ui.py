"""The web page (``kvserve/server/ui``): ``GET /`` and its files, and the live view's data.

- ``GET /``: the page; ``GET /ui/static/NAME``: its scripts and style sheet (only the files
  shipped in the package, no directory listing). Off with ``--no-ui``.
- ``GET /ui/events``: server-sent events, one ``EngineFrame`` as JSON every ``interval`` seconds
  (0.25 to 5, default 0.5), until the client goes away or the server stops.
- ``GET /ui/state``: one frame as JSON (for scripts and tests).
- ``GET /ui/config``: what the page must know before anything else (whether to ask for a key).

With ``--api-key`` the page itself is public (it asks for the key) and the two data routes need
the key like /v1 (the guard middleware checks it): the frames describe other users' requests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, Response

from kvserve.errors import NotFoundError
from kvserve.server.state import State
from kvserve.server.streaming import SSEResponse

router = APIRouter(include_in_schema=False)

UI_DIR = Path(__file__).resolve().parent.parent / "ui"
MEDIA_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
DATA_ROUTES = ("/ui/events", "/ui/state")  # the routes the API key guards (the page and its files are public)


def _file(name: str) -> FileResponse:
    path = UI_DIR / name
    if path.parent != UI_DIR or path.suffix not in MEDIA_TYPES or not path.is_file():
        raise NotFoundError(f"no such file: {name}")
    # no-cache: revalidated on each load, so a page never runs with the files of another version
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers={"Cache-Control": "no-cache"})


@router.get("/")
async def page(state: State) -> Response:
    if not state.config.ui:
        raise NotFoundError("the web page is off (--no-ui)")
    return _file("index.html")


@router.get("/ui/static/{name}")
async def static_file(name: str, state: State) -> Response:
    if not state.config.ui:
        raise NotFoundError("the web page is off (--no-ui)")
    return _file(name)


@router.get("/ui/config")
async def ui_config(state: State) -> dict[str, bool]:
    return {"api_key_required": state.config.api_key is not None}


def _json(frame: object) -> str:
    return json.dumps(asdict(frame), separators=(",", ":"))  # type: ignore[call-overload]


@router.get("/ui/state")
async def ui_state(state: State) -> Response:
    frame = await state.engine_view.frame()
    return Response(_json(frame), media_type="application/json")


@router.get("/ui/events")
async def ui_events(state: State, interval: float = 0.5) -> Response:
    interval = min(max(interval, 0.25), 5.0) if interval == interval else 0.5  # (NaN: the default)
    view = state.engine_view

    async def frames() -> AsyncIterator[str]:
        while not state.stopping:
            started = asyncio.get_running_loop().time()
            yield f"data: {_json(await view.frame())}\n\n"
            elapsed = asyncio.get_running_loop().time() - started
            await asyncio.sleep(max(0.0, interval - elapsed))

    return SSEResponse(frames(), media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
