"""The OpenAI wire format: pydantic models of the requests the server accepts and the responses it sends.

Field names and defaults follow OpenAI's API plus vLLM's extra fields (docs/openai-api.md lists them
all). The models check types; a request's ``check`` its rules across fields; ranges are checked once,
by ``SamplingParams``. Their ``InvalidArgumentError`` the server turns into a 400 naming the field.
The requests live here; the responses in ``protocol_responses``, re-exported (``P.Usage``, ...).
"""

from __future__ import annotations

import math

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from kvserve.engine.request import SamplingParams
from kvserve.errors import InvalidArgumentError
from kvserve.kv.connector import KVTransferParams
from kvserve.server.protocol_extras import OmitsNone, PromptLogprob, PromptLogprobs, StructuredOutputs  # noqa: F401
from kvserve.server.protocol_responses import (  # noqa: F401  (re-exported: P.Usage, P.ChatChoice, ...)
    new_id, now_s, PromptTokensDetails, CompletionTokensDetails, SpeculativeUsage, Usage,
    CompletionLogprobs, CompletionChoice, CompletionResponse, TopLogprob, TokenLogprob, ChatLogprobs,
    FunctionCall, ToolCall, ChatMessageOut, ChatChoice, ChatCompletionResponse, DeltaMessage,
    ChatStreamChoice, ChatCompletionChunk, ModelCard, ModelList, ErrorInfo, ErrorResponse,
)

if TYPE_CHECKING:
    from kvserve.structured.spec import GuidedSpec

MAX_N = 64  # choices per request: each is an engine request of its own


# --------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage on every chunk too


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
    structured_outputs: StructuredOutputs | None = None
    # vLLM's extras
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    return_token_ids: bool = False
    use_beam_search: bool = False  # n beams (kvserve.server.beam), ranked with length_penalty
    length_penalty: float = 1.0
    # vLLM's name: this request's side of a KV handoff between a prefill and a decode replica (kvserve.kv.connector)
    kv_transfer_params: dict[str, Any] | None = None
    # bad_words as token ids (text.tokenizer.bad_words_token_ids), filled by ServerState.prepare
    _bad_words_token_ids: list[list[int]] | None = PrivateAttr(default=None)

    def check(self) -> None:
        """Checks across fields that need no tokenizer (400s naming the field)."""
        if self.stream_options is not None and not self.stream:
            raise InvalidArgumentError("stream_options can only be set when stream is true", param="stream_options")
        if self.stream and self.prompt_logprobs:  # vLLM's rule: they are not streamed
            raise InvalidArgumentError("prompt_logprobs are not available with stream", param="prompt_logprobs")
        if self.kv_transfer_params is not None and (self.n != 1 or self.use_beam_search):
            raise InvalidArgumentError("kv_transfer_params needs n = 1 and no beam search", param="kv_transfer_params")
        if self.use_beam_search:
            self._check_beam_search()  # (judges the output constraint too)
        else:
            self.guided_spec()  # conflicting or malformed constraints

    def _check_beam_search(self) -> None:
        """Beam search ranks beams by the model's raw log-probabilities: what would change the
        distribution, or needs a sampled token's own state, is refused rather than ignored (an
        output constraint included, once ``guided_spec`` has judged it)."""
        from kvserve.engine.beam_search import MAX_BEAM_WIDTH

        if self.n > MAX_BEAM_WIDTH:
            raise InvalidArgumentError(f"with use_beam_search, n (the beam width) must be at most {MAX_BEAM_WIDTH}",
                                       param="n")
        if self.max_tokens == 0:
            raise InvalidArgumentError("use_beam_search needs max_tokens of at least 1", param="max_tokens")
        if not math.isfinite(self.length_penalty):
            raise InvalidArgumentError("length_penalty must be a finite number", param="length_penalty")
        refused = {
            "stop": bool(self.stop),
            "presence_penalty": self.presence_penalty != 0.0, "frequency_penalty": self.frequency_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty not in (None, 1.0), "min_tokens": self.min_tokens > 0,
            "logit_bias": bool(self.logit_bias), "allowed_token_ids": self.allowed_token_ids is not None,
            "bad_words": bool(self.bad_words), "prompt_logprobs": self.prompt_logprobs is not None,
            "logprobs": self._asks_logprobs(),
        }
        guided = self.guided_spec()
        if guided is not None:
            refused[guided.param] = True
        for param, asked in refused.items():
            if asked:
                raise InvalidArgumentError(f"{param} is not supported with use_beam_search", param=param)

    def _asks_logprobs(self) -> bool:
        return False

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats

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
        if self.structured_outputs is not None:
            asked += [("structured_outputs", kind, value) for kind, value in self.structured_outputs.asked()]
        if len(asked) > 1:
            names = [a[0] if a[0] != "structured_outputs" else f"structured_outputs.{a[1]}" for a in asked]
            raise InvalidArgumentError(f"ask for one output constraint at a time, not {', '.join(names)}",
                                       param=asked[1][0])
        if not asked:
            return None
        from kvserve.structured.spec import GuidedSpec

        param, kind, value = asked[0]
        return GuidedSpec(kind, value, param=param)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, index: int, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
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
            prompt_logprobs=prompt_logprobs,
            min_tokens=self.min_tokens,
            logit_bias=self.logit_bias,  # type: ignore[arg-type]  # SamplingParams turns the keys into ints
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            bad_words_token_ids=self._bad_words_token_ids,
            kv_transfer=KVTransferParams.parse(self.kv_transfer_params),
        )


class CompletionRequest(_SamplingRequest):
    # a string, a list of strings, a list of token ids, or a list of token-id lists
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # top-n per token
    echo: bool = False  # the prompt comes first in the text (and, with logprobs, in the logprobs)
    suffix: str | None = None  # not supported (as in vLLM): refused rather than ignored

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise InvalidArgumentError("suffix is not supported", param="suffix")

    def _asks_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt alone (OpenAI's way to score a text)."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, index: int) -> SamplingParams:
        # the engine samples one token for echo_only, which the answer leaves out
        max_tokens = 1 if self.echo_only else self.max_tokens
        prompt_logprobs = None if self.stream else self.prompt_logprobs  # streamed: only echo's are sent
        if self.echo and self.logprobs is not None:  # the echoed prompt's tokens come with logprobs
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        return self._sampling_params(index, max_tokens, self.logprobs, prompt_logprobs)


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
    # vLLM's extras: how the template ends the prompt; echo (the assistant's last message opens the answer)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    # vLLM's: more variables for the chat template (e.g. {"enable_thinking": false} for Qwen3's)
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.use_beam_search and self.tools and self.tool_choice != "none":
            raise InvalidArgumentError("tools are not supported with use_beam_search", param="tools")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidArgumentError("continue_final_message and add_generation_prompt cannot both be true "
                                       "(set add_generation_prompt to false)", param="continue_final_message")

    def _asks_logprobs(self) -> bool:
        return self.logprobs

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(self, index: int) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:  # top_logprobs 0 without logprobs is harmless (vLLM)
            raise InvalidArgumentError("top_logprobs needs logprobs set to true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(index, self.max_output_tokens, logprobs, None if self.stream else self.prompt_logprobs)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict(i) for i, m in enumerate(self.messages)]


class UpdateWeightsRequest(BaseModel):
    """``POST /update_weights_from_disk``: SGLang's body (its other fields are ignored)."""

    model_config = ConfigDict(extra="ignore")
    model_path: str = Field(min_length=1)
    load_format: str | None = None  # auto (None) or dummy, as --load-format
    abort_all_requests: bool = False  # end the requests in flight now, with an error (else they finish first)
