"""Engine outputs to OpenAI's wire format: the completion and chat renderers, usage, logprobs.

A renderer is made per HTTP request, once its engine requests are started, and is handed to
``kvserve.server.streaming.respond``, which calls ``response`` (the whole answer, from each
choice's final output) or ``events`` (the SSE events of a stream). Choice k is prompt k // n's
choice k % n.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel

from kvserve.text.output import RequestOutput
from kvserve.engine.request import TokenLogprobs
from kvserve.server import protocol as P
from kvserve.server.state import ServerState
from kvserve.server.streaming import Event, sse_event

MIN_LOGPROB = -9999.0  # JSON has no -inf: what a token that cannot be sampled (a grammar masks it) shows, as in vLLM

Logprobs = TypeVar("Logprobs", P.CompletionLogprobs, P.ChatLogprobs)


def _logprob(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB  # -inf, and NaN too


def completion_logprobs(state: ServerState, logprobs: list[TokenLogprobs], offset: int) -> P.CompletionLogprobs:
    """The completions API's logprobs of ``logprobs``, whose text starts at ``offset`` in the choice's."""
    out = P.CompletionLogprobs()
    for lp in logprobs:
        text = state.token_text(lp.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(_logprob(lp.logprob))
        out.text_offset.append(offset)
        offset += len(text)
        out.top_logprobs.append({state.token_text(t): _logprob(v) for t, v in lp.top} if lp.top else None)
    return out


def chat_logprobs(state: ServerState, logprobs: list[TokenLogprobs], top_n: int | None) -> P.ChatLogprobs:
    """The chat API's logprobs of ``logprobs``, with the ``top_n`` most likely tokens of each."""
    content = []
    for lp in logprobs:
        text = state.token_text(lp.token_id)
        top = [P.TopLogprob(token=(t := state.token_text(i)), logprob=_logprob(v), bytes=list(t.encode()))
               for i, v in lp.top[: top_n or 0]]
        content.append(P.TokenLogprob(token=text, logprob=_logprob(lp.logprob), bytes=list(text.encode()),
                                      top_logprobs=top))
    return P.ChatLogprobs(content=content)


def usage(prompt_lens: list[int], cached: list[int], outs: dict[int, RequestOutput]) -> P.Usage:
    """Token counts of a request (all its prompts and choices), with speculative decoding's if any."""
    prompt = sum(prompt_lens)
    completion = sum(len(o.token_ids) for o in outs.values())
    result = P.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=P.PromptTokensDetails(cached_tokens=sum(cached)))
    drafted = sum(o.num_draft_tokens for o in outs.values())
    if drafted:
        accepted = sum(o.num_accepted_tokens for o in outs.values())
        verifies = sum(o.num_verify_steps for o in outs.values())
        result.completion_tokens_details = P.CompletionTokensDetails(accepted_prediction_tokens=accepted,
                                                                     rejected_prediction_tokens=drafted - accepted)
        result.speculative = P.SpeculativeUsage(draft_tokens=drafted, accepted_tokens=accepted, verify_steps=verifies,
                                                mean_accepted_length=round(1 + accepted / verifies, 4))
    return result


def _delta_logprobs(out: RequestOutput) -> list[TokenLogprobs]:
    """The logprobs of the tokens new in ``out``."""
    return out.logprobs[len(out.logprobs) - len(out.delta_token_ids):] if out.delta_token_ids else []


class _Renderer(ABC, Generic[Logprobs]):
    """What both renderers share: the response's id and model, usage, and the streaming loop.

    A subclass says how a choice, a delta event, the usage event and a delta's logprobs look.
    """

    ID_PREFIX: ClassVar[str]

    def __init__(self, state: ServerState, body: P._SamplingRequest, model: str, prompt_lens: list[int]):
        self.state = state
        self.body = body
        self.model = model
        self.prompt_lens = prompt_lens
        self.num_choices = len(prompt_lens) * body.n
        self.id, self.created = P.new_id(self.ID_PREFIX), P.now_s()

    def usage(self, outs: dict[int, RequestOutput]) -> P.Usage:
        # cached tokens once per prompt, from its first choice
        cached = [outs[k].num_cached_tokens for k in range(0, self.num_choices, self.body.n) if k in outs]
        return usage(self.prompt_lens, cached, outs)

    def response(self, outs: dict[int, RequestOutput]) -> BaseModel:
        choices = [self._choice(k, outs[k]) for k in range(self.num_choices)]
        return self._response(choices, self.usage(outs))

    async def events(self, events: AsyncIterator[Event], first: Event) -> AsyncIterator[str]:
        for event in self._opening_events():
            yield event
        last: dict[int, RequestOutput] = {}
        item: Event | None = first
        while item is not None:
            k, out = item
            last[k] = out
            lp = self._delta_logprobs(k, out)
            if out.delta_text or out.finished or lp is not None:
                yield self._delta_event(k, out, lp)
            item = await anext(events, None)  # type: ignore[arg-type]
        if self.body.include_usage:
            yield self._usage_event(self.usage(last))

    # -- what a subclass says ------------------------------------------------------------------
    @abstractmethod
    def _choice(self, k: int, out: RequestOutput) -> Any:
        ...

    @abstractmethod
    def _response(self, choices: list[Any], usage: P.Usage) -> BaseModel:
        ...

    def _opening_events(self) -> list[str]:
        """Events sent before the first output's."""
        return []

    @abstractmethod
    def _delta_logprobs(self, k: int, out: RequestOutput) -> Logprobs | None:
        """The logprobs of the tokens new in ``out``, or None when the request asked for none."""
        ...

    @abstractmethod
    def _delta_event(self, k: int, out: RequestOutput, lp: Logprobs | None) -> str:
        ...

    @abstractmethod
    def _usage_event(self, usage: P.Usage) -> str:
        ...


class CompletionRenderer(_Renderer[P.CompletionLogprobs]):
    """/v1/completions: ``prompt_lens`` holds each prompt's length; there are n choices per prompt."""

    ID_PREFIX = "cmpl"
    body: P.CompletionRequest

    def __init__(self, state: ServerState, body: P.CompletionRequest, model: str, prompt_lens: list[int]):
        super().__init__(state, body, model, prompt_lens)
        self.want_logprobs = body.logprobs is not None
        self.offsets: dict[int, int] = {}  # per choice: where its next delta's text starts

    def _choice(self, k: int, out: RequestOutput) -> P.CompletionChoice:
        lp = completion_logprobs(self.state, out.logprobs, 0) if self.want_logprobs else None
        return P.CompletionChoice(index=k, text=out.text, logprobs=lp, finish_reason=out.finish_reason,
                                  stop_reason=out.stop_reason)

    def _response(self, choices: list[P.CompletionChoice], usage: P.Usage) -> P.CompletionResponse:
        return P.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def _delta_logprobs(self, k: int, out: RequestOutput) -> P.CompletionLogprobs | None:
        if not self.want_logprobs:
            return None
        lp = completion_logprobs(self.state, _delta_logprobs(out), self.offsets.get(k, 0))
        self.offsets[k] = self.offsets.get(k, 0) + sum(len(t) for t in lp.tokens)
        return lp

    def _delta_event(self, k: int, out: RequestOutput, lp: P.CompletionLogprobs | None) -> str:
        # model_construct: per-token path, values of our own making need no validation
        choice = P.CompletionChoice.model_construct(
            index=k, text=out.delta_text, logprobs=lp,
            finish_reason=out.finish_reason if out.finished else None,
            stop_reason=out.stop_reason if out.finished else None)
        return sse_event(P.CompletionResponse.model_construct(id=self.id, created=self.created, model=self.model,
                                                              choices=[choice]))

    def _usage_event(self, usage: P.Usage) -> str:
        return sse_event(P.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[],
                                              usage=usage))


class ChatRenderer(_Renderer[P.ChatLogprobs]):
    """/v1/chat/completions: one prompt (``prompt_lens`` has its length), n choices."""

    ID_PREFIX = "chatcmpl"
    body: P.ChatCompletionRequest

    def __init__(self, state: ServerState, body: P.ChatCompletionRequest, model: str, prompt_lens: list[int]):
        super().__init__(state, body, model, prompt_lens)
        self.top_n = (body.top_logprobs or 0) if body.logprobs else None  # None: no logprobs

    def _choice(self, k: int, out: RequestOutput) -> P.ChatChoice:
        lp = chat_logprobs(self.state, out.logprobs, self.top_n) if self.top_n is not None else None
        return P.ChatChoice(index=k, message=P.ChatMessageOut(content=out.text), logprobs=lp,
                            finish_reason=out.finish_reason, stop_reason=out.stop_reason)

    def _response(self, choices: list[P.ChatChoice], usage: P.Usage) -> P.ChatCompletionResponse:
        return P.ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                        usage=usage)

    def _chunk(self, choices: list[P.ChatStreamChoice], usage: P.Usage | None = None) -> str:
        return sse_event(P.ChatCompletionChunk.model_construct(id=self.id, created=self.created, model=self.model,
                                                               choices=choices, usage=usage))

    def _opening_events(self) -> list[str]:
        return [self._chunk([P.ChatStreamChoice(index=k, delta=P.DeltaMessage(role="assistant", content=""))])
                for k in range(self.num_choices)]

    def _delta_logprobs(self, k: int, out: RequestOutput) -> P.ChatLogprobs | None:
        return chat_logprobs(self.state, _delta_logprobs(out), self.top_n) if self.top_n is not None else None

    def _delta_event(self, k: int, out: RequestOutput, lp: P.ChatLogprobs | None) -> str:
        return self._chunk([P.ChatStreamChoice.model_construct(
            index=k, delta=P.DeltaMessage.model_construct(content=out.delta_text or None), logprobs=lp,
            finish_reason=out.finish_reason if out.finished else None,
            stop_reason=out.stop_reason if out.finished else None)])

    def _usage_event(self, usage: P.Usage) -> str:
        return self._chunk([], usage=usage)
