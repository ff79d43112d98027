"""Engine outputs to OpenAI's wire format: the completion and chat renderers, usage, logprobs.

A renderer is made per HTTP request, once its engine requests are started, and is handed to
``kvserve.server.streaming.respond``, which calls ``response`` (the whole answer, from each
choice's final output) or ``events`` (the SSE events of a stream). Choice k is prompt k // n's
choice k % n. With ``--reasoning-parser`` the chat renderer splits each choice's text into its
reasoning and its content (``kvserve.text.reasoning``) before anything else reads it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel

from kvserve.text.output import RequestOutput
from kvserve.text.reasoning import Split
from kvserve.engine.request import TokenLogprobs
from kvserve.server import protocol as P
from kvserve.server.state import ServerState
from kvserve.server.streaming import Event, sse_event

MIN_LOGPROB = -9999.0  # JSON has no -inf: what a token that cannot be sampled (a grammar masks it) shows, as in vLLM

Logprobs = TypeVar("Logprobs", P.CompletionLogprobs, P.ChatLogprobs)


def _logprob(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB  # -inf, and NaN too


def _top_logprobs(state: ServerState, lp: TokenLogprobs, n: int | None) -> dict[str, float]:
    """A completions top_logprobs entry: the n most likely tokens and the token itself, as OpenAI
    promises (so up to n + 1 entries; with logprobs 0, the token alone)."""
    top = {state.token_text(t): _logprob(v) for t, v in lp.top[:n]}
    top.setdefault(state.token_text(lp.token_id), _logprob(lp.logprob))
    return top


def completion_logprobs(state: ServerState, logprobs: list[TokenLogprobs], offset: int,
                        n: int | None = None) -> P.CompletionLogprobs:
    """The completions API's logprobs of ``logprobs``, whose text starts at ``offset`` in the choice's,
    with the ``n`` (default: all there are) most likely tokens of each."""
    out = P.CompletionLogprobs()
    for lp in logprobs:
        text = state.token_text(lp.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(_logprob(lp.logprob))
        out.text_offset.append(offset)
        offset += len(text)
        out.top_logprobs.append(_top_logprobs(state, lp, n))
    return out


def echo_logprobs(state: ServerState, prompt: list[int], logprobs: list[TokenLogprobs] | None,
                  n: int | None) -> P.CompletionLogprobs:
    """The completions logprobs of an echoed prompt: its first token has none (nor has any token
    when ``logprobs`` is None); the text starts at 0."""
    out = P.CompletionLogprobs()
    offset = 0
    for i, token in enumerate(prompt):
        text = state.token_text(token)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        lp = logprobs[i - 1] if logprobs is not None and 0 < i <= len(logprobs) else None
        out.token_logprobs.append(None if lp is None else _logprob(lp.logprob))
        out.top_logprobs.append(None if lp is None else _top_logprobs(state, lp, n))
    return out


def _join(head: P.CompletionLogprobs, tail: P.CompletionLogprobs) -> P.CompletionLogprobs:
    return P.CompletionLogprobs(text_offset=head.text_offset + tail.text_offset,
                                token_logprobs=head.token_logprobs + tail.token_logprobs,
                                tokens=head.tokens + tail.tokens, top_logprobs=head.top_logprobs + tail.top_logprobs)


def prompt_logprobs(state: ServerState, logprobs: list[TokenLogprobs] | None, n: int) -> P.PromptLogprobs | None:
    """vLLM's ``prompt_logprobs``: per prompt token (the first has None) the token's logprob and
    rank, then the ``n`` most likely tokens', keyed by token id."""
    if logprobs is None:
        return None
    out: P.PromptLogprobs = [None]
    for lp in logprobs:
        entry = {lp.token_id: P.PromptLogprob(logprob=_logprob(lp.logprob), rank=lp.rank,
                                              decoded_token=state.token_text(lp.token_id))}
        for rank, (t, v) in enumerate(lp.top[:n], 1):
            entry.setdefault(t, P.PromptLogprob(logprob=_logprob(v), rank=rank, decoded_token=state.token_text(t)))
        out.append(entry)
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


def reasoning_fields(reasoning: str | None) -> dict[str, str | None]:
    """A message's reasoning under both of vLLM's names (``reasoning`` is the newer)."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}


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

    def _choice_usage(self, k: int, out: RequestOutput) -> P.Usage | None:
        """With stream_options.continuous_usage_stats: the usage of choice k so far (as vLLM's
        chunks carry it: that choice's prompt and tokens); else None."""
        if not self.body.continuous_usage:
            return None
        prompt, done = self.prompt_lens[k // self.body.n], self._num_tokens(out)
        return P.Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=out.num_cached_tokens))

    def _num_tokens(self, out: RequestOutput) -> int:
        """The tokens of ``out`` that the answer holds."""
        return len(out.token_ids)

    def response(self, outs: dict[int, RequestOutput]) -> BaseModel:
        choices = [self._choice(k, outs[k]) for k in range(self.num_choices)]
        return self._response(choices, self.usage(outs))

    async def events(self, events: AsyncIterator[Event], first: Event) -> AsyncIterator[str]:
        for event in self._opening_events(first[1]):
            yield event
        last: dict[int, RequestOutput] = {}
        item: Event | None = first
        while item is not None:
            k, out = item
            last[k] = out
            lp = self._delta_logprobs(k, out)
            if out.delta_text or out.finished or lp is not None or self._has_news(k, out):
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

    def _opening_events(self, first: RequestOutput) -> list[str]:
        """Events sent before the first output's (``first``)."""
        return []

    def _has_news(self, k: int, out: RequestOutput) -> bool:
        """Whether ``out`` needs an event even with no new text or logprobs (token ids, an echo)."""
        return self.body.return_token_ids and bool(out.delta_token_ids)

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
        self.started: set[int] = set()  # choices whose first event went out (echo, prompt_token_ids)
        # the prompts as the client wrote them, when it sent text
        prompt = body.prompt
        self.prompt_texts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt[0], str) else None

    def _prompt_text(self, k: int, out: RequestOutput) -> str:
        """Choice k's prompt as echo repeats it: as sent, or decoded when it came as token ids."""
        if self.prompt_texts is not None:
            return self.prompt_texts[k // self.body.n]
        return self.state.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    def _num_tokens(self, out: RequestOutput) -> int:
        return 0 if self.body.echo_only else len(out.token_ids)

    def usage(self, outs: dict[int, RequestOutput]) -> P.Usage:
        result = super().usage(outs)
        if self.body.echo_only:  # the one token the engine sampled is not part of the answer
            result.completion_tokens, result.total_tokens = 0, result.prompt_tokens
        return result

    def _finish(self, out: RequestOutput) -> tuple[str | None, int | str | None]:
        if not out.finished:
            return None, None
        return ("length", None) if self.body.echo_only else (out.finish_reason, out.stop_reason)

    def _choice(self, k: int, out: RequestOutput) -> P.CompletionChoice:
        body = self.body
        text, token_ids, logprobs = ("", [], []) if body.echo_only else (out.text, out.token_ids, out.logprobs)
        lp = None
        if self.want_logprobs:
            n = body.logprobs
            head = echo_logprobs(self.state, out.prompt_token_ids, out.prompt_logprobs, n) if body.echo else None
            lp = completion_logprobs(self.state, logprobs, sum(map(len, head.tokens)) if head else 0, n)
            lp = lp if head is None else _join(head, lp)
        if body.echo:
            text = self._prompt_text(k, out) + text
        finish_reason, stop_reason = self._finish(out)
        return P.CompletionChoice(
            index=k, text=text, logprobs=lp, finish_reason=finish_reason, stop_reason=stop_reason,
            prompt_logprobs=(prompt_logprobs(self.state, out.prompt_logprobs, body.prompt_logprobs)
                             if body.prompt_logprobs is not None else None),
            prompt_token_ids=out.prompt_token_ids if body.return_token_ids else None,
            token_ids=token_ids if body.return_token_ids else None)

    def _response(self, choices: list[P.CompletionChoice], usage: P.Usage) -> P.CompletionResponse:
        return P.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def _has_news(self, k: int, out: RequestOutput) -> bool:
        first = k not in self.started and (self.body.echo or self.body.return_token_ids)
        return first or super()._has_news(k, out)

    def _delta_logprobs(self, k: int, out: RequestOutput) -> P.CompletionLogprobs | None:
        if not self.want_logprobs:
            return None
        n = self.body.logprobs
        head = None
        if self.body.echo and k not in self.started:  # this output's event opens with the prompt
            head = echo_logprobs(self.state, out.prompt_token_ids, out.prompt_logprobs, n)
            self.offsets[k] = sum(map(len, head.tokens))
        lp = completion_logprobs(self.state, [] if self.body.echo_only else _delta_logprobs(out),
                                 self.offsets.get(k, 0), n)
        self.offsets[k] = self.offsets.get(k, 0) + sum(len(t) for t in lp.tokens)
        return lp if head is None else _join(head, lp)

    def _delta_event(self, k: int, out: RequestOutput, lp: P.CompletionLogprobs | None) -> str:
        body, first = self.body, k not in self.started
        self.started.add(k)
        text, token_ids = ("", []) if body.echo_only else (out.delta_text, out.delta_token_ids)
        if body.echo and first:
            text = self._prompt_text(k, out) + text
        finish_reason, stop_reason = self._finish(out)
        # model_construct: per-token path, values of our own making need no validation
        choice = P.CompletionChoice.model_construct(
            index=k, text=text, logprobs=lp, finish_reason=finish_reason, stop_reason=stop_reason,
            prompt_token_ids=out.prompt_token_ids if body.return_token_ids and first else None,
            token_ids=token_ids if body.return_token_ids else None)
        return sse_event(P.CompletionResponse.model_construct(id=self.id, created=self.created, model=self.model,
                                                              choices=[choice], usage=self._choice_usage(k, out)))

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
        last = len(body.messages) - 1  # echo: the assistant's last message opens the answer
        echo = body.echo and body.messages[last].role == "assistant"
        self.echoed = body.messages[last].to_template_dict(last)["content"] if echo else ""
        self.reasoning = state.reasoning_splitter(body)  # None: no --reasoning-parser, the text is all content

    def _split(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer's reasoning (None for none) and content (with a parser, None for none)."""
        return (None, text) if self.reasoning is None else self.reasoning.whole(text)

    def _split_delta(self, k: int, out: RequestOutput) -> Split:
        """The reasoning and content that choice k's new text decides (and at its end, what was held back)."""
        if self.reasoning is None:
            return Split("", out.delta_text)
        return self.reasoning.delta(k, out.delta_text, out.finished)

    def _message(self, content: str | None, reason: str | None) -> tuple[P.ChatMessageOut, str | None]:
        """The message of an answer's content (its text after any reasoning), and its finish reason."""
        if self.echoed:
            content = self.echoed + (content or "")
        return P.ChatMessageOut(content=content), reason

    def _choice(self, k: int, out: RequestOutput) -> P.ChatChoice:
        lp = chat_logprobs(self.state, out.logprobs, self.top_n) if self.top_n is not None else None
        reasoning, content = self._split(out.text)
        message, finish_reason = self._message(content, out.finish_reason)
        if self.reasoning is not None:  # given even when None, so that they show (null), as vLLM's do
            message = message.model_copy(update=reasoning_fields(reasoning))
        return P.ChatChoice(index=k, message=message, logprobs=lp, finish_reason=finish_reason,
                            stop_reason=out.stop_reason,
                            token_ids=out.token_ids if self.body.return_token_ids else None)

    def response(self, outs: dict[int, RequestOutput]) -> BaseModel:
        result = super().response(outs)
        assert isinstance(result, P.ChatCompletionResponse)
        body, first = self.body, outs[0]
        if body.prompt_logprobs is not None:
            result.prompt_logprobs = prompt_logprobs(self.state, first.prompt_logprobs, body.prompt_logprobs)
        if body.return_token_ids:
            result.prompt_token_ids = first.prompt_token_ids
        return result

    def _response(self, choices: list[P.ChatChoice], usage: P.Usage) -> P.ChatCompletionResponse:
        return P.ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                        usage=usage)

    def _chunk(self, choices: list[P.ChatStreamChoice], usage: P.Usage | None = None,
               prompt_token_ids: list[int] | None = None) -> str:
        return sse_event(P.ChatCompletionChunk.model_construct(id=self.id, created=self.created, model=self.model,
                                                               choices=choices, usage=usage,
                                                               prompt_token_ids=prompt_token_ids))

    def _opening_events(self, first: RequestOutput) -> list[str]:
        # the role, then the echoed text; with return_token_ids, the prompt's ids on the first chunk
        ids = first.prompt_token_ids if self.body.return_token_ids else None
        prompt = self.prompt_lens[0]
        usage = (P.Usage(prompt_tokens=prompt, completion_tokens=0, total_tokens=prompt,
                         prompt_tokens_details=P.PromptTokensDetails(cached_tokens=first.num_cached_tokens))
                 if self.body.continuous_usage else None)
        events = [self._chunk([P.ChatStreamChoice(index=k, delta=P.DeltaMessage(role="assistant", content=""))],
                              usage, ids if k == 0 else None) for k in range(self.num_choices)]
        if self.echoed:
            events += [self._chunk([P.ChatStreamChoice(index=k, delta=P.DeltaMessage(content=self.echoed))], usage)
                       for k in range(self.num_choices)]
        return events

    def _delta_logprobs(self, k: int, out: RequestOutput) -> P.ChatLogprobs | None:
        return chat_logprobs(self.state, _delta_logprobs(out), self.top_n) if self.top_n is not None else None

    def _delta_event(self, k: int, out: RequestOutput, lp: P.ChatLogprobs | None) -> str:
        """A chunk of the delta; "" while the reasoning parser holds the text back (it may be a tag)
        and nothing else must go out (an empty body part, which HTTP servers do not send)."""
        reasoning, content = self._split_delta(k, out)
        token_ids = out.delta_token_ids if self.body.return_token_ids else None
        if not (reasoning or content or out.finished or lp is not None or token_ids or self.body.continuous_usage):
            return ""
        delta = P.DeltaMessage.model_construct(content=content or None, **reasoning_fields(reasoning or None))
        return self._chunk([P.ChatStreamChoice.model_construct(
            index=k, delta=delta, logprobs=lp, finish_reason=out.finish_reason if out.finished else None,
            stop_reason=out.stop_reason if out.finished else None, token_ids=token_ids)], self._choice_usage(k, out))

    def _usage_event(self, usage: P.Usage) -> str:
        return self._chunk([], usage=usage)
