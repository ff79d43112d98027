"""The chat renderer of a request that may call tools: ``message.tool_calls`` in a whole answer,
OpenAI's call deltas in a stream (``kvserve.server.tools.ToolPlan`` parses the text). With a
reasoning parser, only the content is parsed for calls: a call the model thinks about is no call."""

from __future__ import annotations

from kvserve.server import protocol as P
from kvserve.server.render import ChatRenderer, reasoning_fields
from kvserve.server.state import ServerState
from kvserve.server.tools import ToolPlan, finish_reason
from kvserve.text.output import RequestOutput


class ToolChatRenderer(ChatRenderer):
    def __init__(self, state: ServerState, body: P.ChatCompletionRequest, model: str, prompt_lens: list[int],
                 tools: ToolPlan):
        super().__init__(state, body, model, prompt_lens)
        self.tools = tools

    def _message(self, content: str | None, reason: str | None) -> tuple[P.ChatMessageOut, str | None]:
        return self.tools.message(content or "", reason)

    def _delta_event(self, k: int, out: RequestOutput, lp: P.ChatLogprobs | None) -> str:
        """A chunk per delta (content, a call's opening, its arguments): the first carries the
        logprobs and token ids, the last the finish reason and usage. "" while the parser holds the
        text back and nothing else must go out (an empty body part, which HTTP servers do not send)."""
        reasoning, content = self._split_delta(k, out)
        deltas, num_calls = self.tools.deltas(k, content, out.finished)
        if reasoning:  # before any content: the thinking ends where the content starts
            deltas.insert(0, P.DeltaMessage.model_construct(**reasoning_fields(reasoning)))
        token_ids = out.delta_token_ids if self.body.return_token_ids else None
        if not deltas and (out.finished or lp is not None or token_ids or self.body.continuous_usage):
            deltas = [P.DeltaMessage.model_construct()]
        last = len(deltas) - 1
        usage = self._choice_usage(k, out)
        return "".join(self._chunk([P.ChatStreamChoice.model_construct(
            index=k, delta=d, logprobs=lp if i == 0 else None,
            finish_reason=finish_reason(out.finish_reason, num_calls) if out.finished and i == last else None,
            stop_reason=out.stop_reason if out.finished and i == last else None,
            token_ids=token_ids if i == 0 else None)], usage if i == last else None) for i, d in enumerate(deltas))
