"""From tokens to what a user sees: incremental text, stop strings, final outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.engine.messages import RequestDelta
from kvserve.engine.request import FinishReason, Request, TokenLogprobs
from kvserve.text.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from kvserve.text.tokenizer import Tokenizer


@dataclass
class RequestOutput:
    """A request's state after a step: the whole answer so far plus what is new since the last one."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt: str | None = None
    # speculative decoding, so far: drafted tokens verified, of which accepted, in how many steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    # with prompt_logprobs: those of prompt tokens 1, 2, ... (the first token has none)
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class _TextState:
    def __init__(self, req: Request, tokenizer: "Tokenizer | None"):
        self.req = req
        self.detok = None
        if tokenizer is not None:
            self.detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids,
                                                skip_special_tokens=req.params.skip_special_tokens)
        self.text = ""
        self.sent_text = 0  # characters of text already handed out
        self.sent_tokens = 0
        self.detok_tokens = 0  # output tokens already through the detokenizer
        self.holdback = max((len(s) for s in req.params.stop), default=1) - 1


class OutputProcessor:
    """Detokenizes each new token, finds stop strings, and builds RequestOutputs.

    The one place a client learns that a request is finished: the engine ends it on EOS, a
    stop token or a length limit (a delta says so), a stop string ends it here. ``apply``
    reports the latter so the caller can abort it in the engine, which still thinks it runs.
    While a request streams, the last ``len(longest stop) - 1`` characters are held back,
    since they may be the start of a stop string that the next token completes.
    """

    def __init__(self, tokenizer: "Tokenizer | None"):
        self.tokenizer = tokenizer
        self._states: dict[str, _TextState] = {}

    def add(self, req: Request) -> None:
        self._states[req.request_id] = _TextState(req, self.tokenizer)

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def apply(self, request_id: str, deltas: list[RequestDelta]) -> tuple[RequestOutput, bool]:
        """Bring the client's copy of a request (the Request given to ``add``) up to date with the
        engine's deltas, then ``process`` it."""
        req = self._states[request_id].req
        for d in deltas:
            req.token_ids.extend(d.new_token_ids)
            req.logprobs.extend(d.new_logprobs)
            if d.prompt_logprobs is not None:
                req.prompt_logprobs = d.prompt_logprobs
            req.num_cached_tokens = d.num_cached_tokens
            req.spec.num_verifies, req.spec.num_draft_tokens, req.spec.num_accepted_tokens = d.spec
            if d.finished:
                req.finish(FinishReason(d.finish_reason), d.stop_reason)
        return self.process(req)

    def process(self, req: Request) -> tuple[RequestOutput, bool]:
        """Returns the output for ``req`` (with every token it got since the last call; several
        at once with speculative decoding) and whether a stop string just finished it."""
        st = self._states[req.request_id]
        out_ids = req.output_token_ids
        stopped_by_string = False
        if st.detok is not None:
            for tok in out_ids[st.detok_tokens :]:
                st.detok_tokens += 1
                delta = st.detok.step(tok)
                if not delta:
                    continue
                start = max(0, len(st.text) - st.holdback)
                st.text += delta
                # as in vLLM, no stop string ends the output within its first min_tokens tokens
                look = req.params.stop and st.detok_tokens > req.params.min_tokens
                hit = _find_stop(st.text, req.params.stop, start) if look else None
                if hit is not None:
                    idx, stop = hit
                    st.text = st.text[: idx + len(stop)] if req.params.include_stop_str_in_output else st.text[:idx]
                    req.finish(FinishReason.STOP, stop_reason=stop)
                    stopped_by_string = True
                    # tokens that came in the same step after the one completing the stop are not output
                    del req.token_ids[req.num_prompt_tokens + st.detok_tokens :]
                    del req.logprobs[st.detok_tokens :]
                    out_ids = req.output_token_ids
                    break
        if req.is_finished and not stopped_by_string and st.detok is not None:
            st.text += st.detok.flush()  # bytes of a character the output ended inside
        finished = req.is_finished
        upto = len(st.text) if finished else max(st.sent_text, len(st.text) - st.holdback)
        delta_text = st.text[st.sent_text : upto]
        st.sent_text = upto
        delta_ids = out_ids[st.sent_tokens :]
        st.sent_tokens = len(out_ids)
        out = RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            text=st.text,
            token_ids=out_ids,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            finished=finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            stop_reason=req.stop_reason,
            # a copy: the request's list grows with later steps, before a slow reader renders this one
            logprobs=req.logprobs[:],
            num_cached_tokens=req.num_cached_tokens,
            num_draft_tokens=req.spec.num_draft_tokens,
            num_accepted_tokens=req.spec.num_accepted_tokens,
            num_verify_steps=req.spec.num_verifies,
            prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs is not None else None,
        )
        if finished:
            self.drop(req.request_id)
        return out, stopped_by_string


def _find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best
