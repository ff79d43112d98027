"""The OpenAI wire format, responses: completions, chat completions and their stream chunks, usage,
logprobs, tool calls, model cards and error bodies (``kvserve.server.protocol`` re-exports them all).
Extras (vLLM's and kvserve's) appear only when they carry something (``OmitsNone``)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer

from kvserve.server.protocol_extras import OmitsNone, PromptLogprobs

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    """OpenAI's names for drafted tokens (its Predicted Outputs): accepted and rejected drafts."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class SpeculativeUsage(BaseModel):
    """kvserve's extension: how speculative decoding fared for this request."""

    draft_tokens: int
    accepted_tokens: int
    verify_steps: int
    mean_accepted_length: float | None  # tokens emitted per verify step (accepted drafts + 1)


class Usage(OmitsNone):
    OMIT_IF_NONE = ("completion_tokens_details", "speculative")

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None
    speculative: SpeculativeUsage | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OmitsNone):
    OMIT_IF_NONE = ("prompt_logprobs", "prompt_token_ids", "token_ids")

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it
    # vLLM's extras: prompt_logprobs, and return_token_ids (a stream sends prompt_token_ids once)
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(OmitsNone):
    # with --reasoning-parser, always there (null when the answer has none), as vLLM sends them;
    # ``reasoning`` is vLLM's newer name of ``reasoning_content``
    OMIT_IF_UNSET = ("reasoning_content", "reasoning")

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(OmitsNone):
    OMIT_IF_NONE = ("token_ids",)

    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatCompletionResponse(OmitsNone):
    OMIT_IF_NONE = ("prompt_logprobs", "prompt_token_ids")

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extras
    prompt_token_ids: list[int] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # pieces of calls, as OpenAI streams them
    reasoning_content: str | None = None  # with --reasoning-parser: pieces of the thinking (and its newer name)
    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(OmitsNone):
    OMIT_IF_NONE = ("token_ids",)

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(OmitsNone):
    OMIT_IF_NONE = ("prompt_token_ids",)

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # on the first chunk, with return_token_ids


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo

