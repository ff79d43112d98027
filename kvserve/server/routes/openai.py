"""The OpenAI API: /v1/models, /v1/completions, /v1/chat/completions.

A completion route checks the model and the request's fields, tokenizes, starts prompts x n
engine requests (``ServerState.start``), and answers through ``respond`` with the renderer of its
API. The OpenAI routes this server does not serve (embeddings, audio, ...) answer a 404 that
says so (docs/openai-api.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvserve.errors import NotFoundError
from kvserve.server import protocol as P
from kvserve.server.beam import beam_streams
from kvserve.server.render import ChatRenderer, CompletionRenderer
from kvserve.server.state import State
from kvserve.server.tool_render import ToolChatRenderer
from kvserve.server.streaming import respond

router = APIRouter()


@router.get("/v1/models")
async def models(state: State) -> P.ModelList:
    created = P.now_s()
    client = state.client
    cards = [P.ModelCard(id=name, created=created, root=client.model_name, max_model_len=client.max_model_len)
             for name in state.names]
    cards += [P.ModelCard(id=name, created=created, root=name, parent=state.names[0],
                          max_model_len=client.max_model_len) for name in state.adapters]
    return P.ModelList(data=cards)


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, state: State) -> P.ModelCard:
    name = state.check_model(model_id)
    adapter = name not in state.names
    return P.ModelCard(id=name, created=P.now_s(), root=name if adapter else state.client.model_name,
                       parent=state.names[0] if adapter else None, max_model_len=state.client.max_model_len)


@router.post("/v1/completions")
async def completions(body: P.CompletionRequest, request: Request, state: State) -> Response:
    model = state.check_model(body.model)
    await state.prepare(body)
    prompts = await state.completion_prompts(body.prompt)
    if body.use_beam_search:
        body.sampling_params(0)  # the ranges of what beam search uses (max_tokens, ...)
        streams = beam_streams(state, prompts, body, body.max_tokens)
    else:
        streams = state.start(prompts, body, body.sampling_params, model=model, headers=request.headers)
    renderer = CompletionRenderer(state, body, model, [len(p) for p in prompts])
    return await respond(request, streams, body.stream, renderer)


@router.post("/v1/chat/completions")
async def chat_completions(body: P.ChatCompletionRequest, request: Request, state: State) -> Response:
    model = state.check_model(body.model)
    await state.prepare(body)
    tools = state.tools.plan(body)  # None unless the answer may call tools
    prompt = await state.chat_prompt(body, tools)
    if body.use_beam_search:
        body.sampling_params(0)  # the ranges of what beam search uses (max_tokens, ...)
        streams = beam_streams(state, [prompt], body, body.max_output_tokens)
    else:
        streams = state.start([prompt], body, tools.sampling_params(body) if tools else body.sampling_params,
                              model=model, headers=request.headers)
    renderer = ChatRenderer(state, body, model, [len(prompt)]) if tools is None else \
        ToolChatRenderer(state, body, model, [len(prompt)], tools)
    return await respond(request, streams, body.stream, renderer)


# OpenAI's routes that this server does not serve: a 404 that says so, rather than a bare "Not Found"
UNSUPPORTED = {
    "/v1/embeddings": "embeddings",
    "/v1/responses": "the Responses API",
    "/v1/responses/{rest:path}": "the Responses API",
    "/v1/audio/{rest:path}": "audio",
    "/v1/images/{rest:path}": "images",
    "/v1/moderations": "moderations",
    "/v1/files": "files",
    "/v1/files/{rest:path}": "files",
    "/v1/batches": "batches",
    "/v1/batches/{rest:path}": "batches",
    "/v1/fine_tuning/{rest:path}": "fine-tuning",
    "/v1/assistants": "assistants",
    "/v1/assistants/{rest:path}": "assistants",
    "/v1/threads": "threads",
    "/v1/threads/{rest:path}": "threads",
    "/v1/vector_stores": "vector stores",
    "/v1/vector_stores/{rest:path}": "vector stores",
    "/v1/realtime": "the Realtime API",
    "/v1/realtime/{rest:path}": "the Realtime API",
}


def _unsupported(what: str) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:
        raise NotFoundError(f"{request.method} {request.url.path} is not supported by this server (no {what}); "
                            "it serves text generation only (/v1/completions, /v1/chat/completions)",
                            code="unsupported_endpoint")
    return route


for _path, _what in UNSUPPORTED.items():
    router.add_api_route(_path, _unsupported(_what), methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                         include_in_schema=False)
