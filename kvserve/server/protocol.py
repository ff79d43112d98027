"""The OpenAI wire format: pydantic models of the requests the server accepts and the responses it sends.

Field names and defaults follow OpenAI's API, plus vLLM's extra sampling fields (``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ...). The models check types only: ranges are
checked once, by ``SamplingParams``, whose ``InvalidArgumentError`` the server turns into a 400.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from kvserve.engine.request import SamplingParams
from kvserve.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvserve.structured.spec import GuidedSpec

MAX_N = 64  # choices per request: each is an engine request of its own


# --------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")  # unknown fields are ignored, as OpenAI does

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # structured output: OpenAI's response_format, or one of vLLM's guided_* fields
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def guided_spec(self) -> GuidedSpec | None:
        """The one output constraint the request asks for, if any; 400 if it asks for several."""
        asked: list[tuple[str, str, Any]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", "json_object", None))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidArgumentError("response_format json_schema needs json_schema.schema",
                                           param="response_format")
            asked.append(("response_format", "json_schema", rf.json_schema.schema_))
        for param, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                            ("guided_grammar", "grammar")):
            if getattr(self, param) is not None:
                asked.append((param, kind, getattr(self, param)))
        if len(asked) > 1:
            raise InvalidArgumentError(f"ask for one output constraint at a time, not {', '.join(a[0] for a in asked)}",
                                       param=asked[1][0])
        if not asked:
            return None
        from kvserve.structured.spec import GuidedSpec

        param, kind, value = asked[0]
        return GuidedSpec(kind, value, param=param)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, index: int, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        # n choices are n engine requests; with a seed, choice i > 0 gets seed + i
        seed = self.seed if self.seed is None or index == 0 else (self.seed + index) % (1 << 64)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            guided=self.guided_spec(),
        )


class CompletionRequest(_SamplingRequest):
    # a string, a list of strings, a list of token ids, or a list of token-id lists
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # top-n per token
    echo: bool = False

    def sampling_params(self, index: int) -> SamplingParams:
        if self.echo:
            raise InvalidArgumentError("echo is not supported", param="echo")
        return self._sampling_params(index, self.max_tokens, self.logprobs)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(BaseModel):
    """A call in an assistant message of the history."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def to_template_dict(self, index: int) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" or p.text is None for p in content):
                raise InvalidArgumentError(f"messages[{index}]: only text content parts are supported",
                                           param="messages")
            content = "".join(p.text or "" for p in content)
        out: dict[str, Any] = {"role": self.role, "content": content if content is not None else ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]  # see kvserve.server.tools
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    # function calling (kvserve.server.tools checks them)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = None  # the newer name of max_tokens; wins when both are set
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM's extra

    def sampling_params(self, index: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidArgumentError("top_logprobs needs logprobs set to true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(index, max_tokens, logprobs)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict(i) for i, m in enumerate(self.messages)]


# --------------------------------------------------------------------------- responses


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


class Usage(BaseModel):
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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it


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


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # pieces of calls, as OpenAI streams them

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    root: str | None = None
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
