"""Reasoning in generated text: a ``<think>`` model's thinking split from its answer, incrementally.

``--reasoning-parser NAME`` picks a parser from ``REASONING_PARSERS`` (vLLM's names):

- ``deepseek_r1``: the output starts inside the thinking block (DeepSeek-R1's template opens it in
  the prompt). Everything before the first ``</think>`` is reasoning, a leading ``<think>`` is
  dropped; an output with no ``</think>`` (cut off while thinking) is all reasoning.
- ``qwen3``: reasoning only in a ``<think>`` ... ``</think>`` block the output opens with (after
  optional whitespace); an output that opens none is all content. A block never closed is reasoning
  to the end, as with ``deepseek_r1``.

``ReasoningParser.feed`` takes the output as it streams and returns the reasoning and the content
that piece decides. Every decision depends on the text only, never on where a piece ends: text that
may still become a tag (``</thi``) is held back until the next piece, or the end, decides; so
``split``, the same parser fed a whole text, always agrees with the stream; ``ReasoningSplitter``
keeps one request's parsers, one per choice. After ``</think>`` everything is content, tags
included. With ``enable_thinking: false`` in the request's
``chat_template_kwargs`` (Qwen3's switch: its template then closes an empty block in the prompt)
the whole output is content, whatever the parser.

No torch here. The server's chat renderer splits first; tool calls are read from the content only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple

from kvserve.errors import InvalidArgumentError

THINK_START, THINK_END = "<think>", "</think>"


class Split(NamedTuple):
    """Text a parser has decided on: reasoning, then content ("" for none)."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Incremental splitter of one output; a subclass says whether the output starts in its thinking block."""

    starts_thinking: ClassVar[bool] = False

    def __init__(self, thinking: bool = True):
        self._buf = ""  # text not decided yet
        # start: before the first non-whitespace text (is it <think>?); thinking; content
        self._state = "start" if thinking else "content"

    def feed(self, text: str) -> Split:
        """What ``text`` (the next piece of the output) decides."""
        self._buf += text
        return self._run(final=False)

    def finish(self) -> Split:
        """What was held back, at the end of the output."""
        return self._run(final=True)

    def _run(self, final: bool) -> Split:
        reasoning = content = ""
        if self._state == "start":
            self._open(final)
        if self._state == "thinking":
            end = self._buf.find(THINK_END)
            if end >= 0:
                reasoning, self._buf = self._buf[:end], self._buf[end + len(THINK_END):]
                self._state = "content"
            else:
                cut = len(self._buf) - (0 if final else _partial_tag(self._buf, THINK_END))
                reasoning, self._buf = self._buf[:cut], self._buf[cut:]
        if self._state == "content":
            content, self._buf = self._buf, ""
        return Split(reasoning, content)

    def _open(self, final: bool) -> None:
        """Leave the start state once the text says whether it opens with ``<think>`` (dropped)."""
        head = self._buf.lstrip()
        if head.startswith(THINK_START):
            self._buf, self._state = head[len(THINK_START):], "thinking"
        elif final or not THINK_START.startswith(head):  # (while head is "" or "<thi", wait)
            self._state = "thinking" if self.starts_thinking else "content"


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that starts ``tag`` (but is not all of it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_thinking = True


class Qwen3ReasoningParser(ReasoningParser):
    starts_thinking = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def register_reasoning_parser(name: str, parser: type[ReasoningParser]) -> None:
    """Make ``parser`` available as ``--reasoning-parser name``."""
    REASONING_PARSERS[name] = parser


def check_reasoning_parser(name: str) -> None:
    if name not in REASONING_PARSERS:
        raise InvalidArgumentError(f"--reasoning-parser must be one of {', '.join(sorted(REASONING_PARSERS))}, "
                                   f"got {name!r}", param="reasoning_parser")


def thinking_enabled(chat_template_kwargs: Mapping[str, Any] | None) -> bool:
    """False when the request turned thinking off in its template (``enable_thinking: false``)."""
    return (chat_template_kwargs or {}).get("enable_thinking") is not False


def split(parser: ReasoningParser, text: str) -> tuple[str | None, str | None]:
    """A whole output's reasoning and content (None for none), by a fresh ``parser`` fed it in one piece."""
    head, tail = parser.feed(text), parser.finish()
    return (head.reasoning + tail.reasoning) or None, (head.content + tail.content) or None


class ReasoningSplitter:
    """One request's splitting: a fresh parser per whole answer, one per choice while streaming."""

    def __init__(self, make: Callable[[], ReasoningParser]):
        self.make = make
        self._parsers: dict[int, ReasoningParser] = {}

    @classmethod
    def of(cls, name: str, chat_template_kwargs: Mapping[str, Any] | None = None) -> ReasoningSplitter:
        """Parser ``name``'s splitter for a request with these ``chat_template_kwargs``."""
        check_reasoning_parser(name)
        parser, thinking = REASONING_PARSERS[name], thinking_enabled(chat_template_kwargs)
        return cls(lambda: parser(thinking))

    def whole(self, text: str) -> tuple[str | None, str | None]:
        return split(self.make(), text)

    def delta(self, k: int, text: str, finished: bool) -> Split:
        """What choice ``k``'s next piece of text decides; at its end, what was held back too."""
        parser = self._parsers.get(k)
        if parser is None:
            parser = self._parsers[k] = self.make()
        now = parser.feed(text)
        if finished:
            tail = parser.finish()
            now = Split(now.reasoning + tail.reasoning, now.content + tail.content)
        return now
