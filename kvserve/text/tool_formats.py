"""Tool-call formats: how a model family writes calls (Hermes, Llama-3 JSON, Mistral), for the
parser (``kvserve.text.tool_parsers``), the grammar and the prompt (``kvserve.server.tools``).

A format's openings and continuations are patterns: literal strings, ``WS`` (any whitespace) and
``NAME`` (a JSON string naming a tool). ``match`` tells whether a text starts with one (FULL),
may still (PARTIAL: the text ends first), or does not (FAIL), without regard to where a stream's
chunks end.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

WS = object()  # any run of whitespace, possibly empty
NAME = object()  # a JSON string: the tool's name
MAX_OPENING_CHARS = 1024  # an opening longer than this is not one (bounds what is held back)

FULL, PARTIAL, FAIL = "full", "partial", "fail"
WHITESPACE = " \t\r\n"


def _call(arg_keys: tuple[str, ...]) -> tuple:
    """The opening of a call object, up to the brace that starts its arguments."""
    return ("{", WS, '"name"', WS, ":", WS, NAME, WS, ",", WS, tuple(f'"{k}"' for k in arg_keys), WS, ":", WS, "{")


@dataclass(frozen=True)
class Opener:
    pattern: tuple
    marker_len: int  # elements that make it a call attempt: a failure after them is a malformed call
    fallback_end: str | None = None  # where a malformed call's text ends (None: at the end of the text)


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes tool calls, for the parser, the grammar and the prompt."""

    name: str
    openers: tuple[Opener, ...]
    # after a call's arguments: (pattern, another call follows); the call object's "}" included
    continuations: tuple[tuple[tuple, bool], ...]
    arg_key: str  # the key this family writes the arguments under
    # the constrained form: each call is call_begin(name) + arguments + call_end, calls separated by
    # separator, all inside prefix ... suffix; trigger starts the calls in free text
    call_prefix: str
    call_end: str
    separator: str
    prefix: str
    suffix: str
    trigger: str

    def call_begin(self, name: str) -> str:
        return f'{self.call_prefix}{{"name": {json.dumps(name)}, "{self.arg_key}": '

    def render(self, calls: Sequence[tuple[str, object]]) -> str:
        """The text of ``calls`` ((name, arguments) pairs) as this format writes them."""
        body = self.separator.join(f"{self.call_begin(n)}{json.dumps(a, ensure_ascii=False)}{self.call_end}"
                                   for n, a in calls)
        return f"{self.prefix}{body}{self.suffix}"


HERMES = ToolFormat(
    name="hermes",
    openers=(Opener(("<tool_call>", WS, *_call(("arguments", "parameters"))), 1, "</tool_call>"),),
    continuations=(((WS, "}", WS, "</tool_call>"), False),),
    arg_key="arguments", call_prefix="<tool_call>\n", call_end="}\n</tool_call>", separator="\n", prefix="",
    suffix="", trigger="<tool_call>")

LLAMA3_JSON = ToolFormat(
    name="llama3_json",
    openers=(Opener(("<|python_tag|>", WS, *_call(("parameters", "arguments"))), 1),
             Opener(_call(("parameters", "arguments")), 0)),
    continuations=(((WS, "}", WS, ";", WS, *_call(("parameters", "arguments"))), True), ((WS, "}"), False)),
    arg_key="parameters", call_prefix="", call_end="}", separator="; ", prefix="", suffix="", trigger='{"name": ')

MISTRAL = ToolFormat(
    name="mistral",
    openers=(Opener(("[TOOL_CALLS]", WS, "[", WS, *_call(("arguments", "parameters"))), 1),),
    continuations=(((WS, "}", WS, ",", WS, *_call(("arguments", "parameters"))), True), ((WS, "}", WS, "]"), False)),
    arg_key="arguments", call_prefix="", call_end="}", separator=", ", prefix="[TOOL_CALLS][", suffix="]",
    trigger="[TOOL_CALLS]")

FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


@dataclass
class Match:
    status: str
    end: int = 0  # where the match ends (FULL)
    matched: int = 0  # elements matched before a failure
    name: str | None = None


def match(pattern: tuple, text: str, pos: int, names: frozenset[str] | None = None) -> Match:
    """Match ``pattern`` at ``text[pos:]``: FULL, PARTIAL (the text ends while it still fits) or FAIL.

    A NAME not in ``names`` (when given) fails, and so does an opening over MAX_OPENING_CHARS.
    """
    start, name = pos, None
    for i, element in enumerate(pattern):
        if pos - start > MAX_OPENING_CHARS:
            return Match(FAIL, matched=i)
        if element is WS:
            while pos < len(text) and text[pos] in WHITESPACE:
                pos += 1
            if pos - start > MAX_OPENING_CHARS:
                return Match(FAIL, matched=i)
            if pos == len(text):
                return Match(PARTIAL, matched=i)
        elif element is NAME:
            limit = start + MAX_OPENING_CHARS
            end = _string_end(text, pos, limit)
            if end == -2 or (end == -1 and len(text) >= limit):
                return Match(FAIL, matched=i)
            if end == -1:
                return Match(PARTIAL, matched=i)
            try:
                name = json.loads(text[pos:end])
            except ValueError:
                return Match(FAIL, matched=i)
            if names is not None and name not in names:
                return Match(FAIL, matched=i)
            pos = end
        else:
            options = element if isinstance(element, tuple) else (element,)
            rest = text[pos:]
            hit = next((o for o in options if rest.startswith(o)), None)
            if hit is not None:
                pos += len(hit)
            elif any(o.startswith(rest) for o in options):
                return Match(PARTIAL, matched=i)
            else:
                return Match(FAIL, matched=i)
    return Match(FULL, end=pos, matched=len(pattern), name=name)


def _string_end(text: str, pos: int, limit: int) -> int:
    """The end of the JSON string starting at ``pos`` and closing before ``limit``; -1 if the text
    (or the limit) comes first, -2 if no string starts there."""
    if pos >= len(text):
        return -1
    if text[pos] != '"':
        return -2
    i, stop = pos + 1, min(len(text), limit)
    while i < stop:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return -1


def detect_format(chat_template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template's text shows, if any."""
    text = chat_template or ""
    if "<tool_call>" in text:
        return HERMES
    if "[TOOL_CALLS]" in text:
        return MISTRAL
    if "<|python_tag|>" in text or "ipython" in text:
        return LLAMA3_JSON
    return None
