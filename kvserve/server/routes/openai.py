"""The OpenAI API: /v1/models, /v1/completions, /v1/chat/completions.

A completion route checks the model, tokenizes, starts prompts x n engine requests
(``ServerState.start``), and answers through ``respond`` with the renderer of its API.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvserve.server import protocol as P
from kvserve.server.render import ChatRenderer, CompletionRenderer
from kvserve.server.state import State
from kvserve.server.tool_render import ToolChatRenderer
from kvserve.server.streaming import respond

router = APIRouter()


@router.get("/v1/models")
async def models(state: State) -> P.ModelList:
    created = P.now_s()
    client = state.client
    return P.ModelList(data=[P.ModelCard(id=name, created=created, root=client.model_name,
                                         max_model_len=client.max_model_len) for name in state.names])


@router.post("/v1/completions")
async def completions(body: P.CompletionRequest, request: Request, state: State) -> Response:
    model = state.check_model(body.model)
    prompts = await state.completion_prompts(body.prompt)
    streams = state.start(prompts, body, body.sampling_params)
    renderer = CompletionRenderer(state, body, model, [len(p) for p in prompts])
    return await respond(request, streams, body.stream, renderer)


@router.post("/v1/chat/completions")
async def chat_completions(body: P.ChatCompletionRequest, request: Request, state: State) -> Response:
    model = state.check_model(body.model)
    tools = state.tools.plan(body)  # None unless the answer may call tools
    prompt = await state.chat_prompt(body, tools)
    streams = state.start([prompt], body, tools.sampling_params(body) if tools else body.sampling_params)
    renderer = ChatRenderer(state, body, model, [len(prompt)]) if tools is None else \
        ToolChatRenderer(state, body, model, [len(prompt)], tools)
    return await respond(request, streams, body.stream, renderer)
