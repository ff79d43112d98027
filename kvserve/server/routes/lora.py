"""vLLM's runtime LoRA routes: ``POST /v1/load_lora_adapter`` {"lora_name", "lora_path"} and
``POST /v1/unload_lora_adapter`` {"lora_name"}. Paths are confined to --lora-dir; the /v1 prefix puts them behind
--api-key (``middleware.GuardMiddleware``). Requests then name an adapter as their ``model``."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from kvserve.errors import InvalidArgumentError
from kvserve.lora.registry import check_lora_name, confined_path
from kvserve.server.state import ServerState, State

router = APIRouter()


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name is what counts here


def _check_enabled(state: ServerState) -> None:
    if getattr(state.client, "lora_adapters", None) is None:
        raise InvalidArgumentError("LoRA adapters are off: start the server with --enable-lora", param="lora_name")


async def _call(state: ServerState, action: str, name: str, path: str | None = None) -> None:
    # raises the engine's error: 404 if the adapter or its folder is missing, else 400
    await state.client.lora_command(action, name, path)  # type: ignore[attr-defined]


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRARequest, state: State) -> PlainTextResponse:
    _check_enabled(state)
    name = check_lora_name(body.lora_name)
    if name in state.names:
        raise InvalidArgumentError(f"{name!r} is the base model's name", param="lora_name")
    path = confined_path(body.lora_path, state.client.config.lora.lora_dir)
    await _call(state, "load", name, path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRARequest, state: State) -> PlainTextResponse:
    _check_enabled(state)
    await _call(state, "unload", body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
