"""Tool calls in generated text: the Hermes, Llama-3 JSON and Mistral formats, parsed incrementally.

``ToolCallParser.feed`` takes the text as it streams and returns events: content outside calls,
the start of a call (its name), and pieces of its arguments (raw JSON text, as the model wrote it).
``parse`` runs the same parser over a whole text, so a streamed answer and a whole one always
agree, however the stream was cut. Every decision depends on the text only, never on where a
chunk ends: text that may still become a call marker is held back until the next chunk decides.

A call is recognised once its opening is complete (``<tool_call>{"name": "f", "arguments": {``
for Hermes; whitespace is free; see ``kvserve.text.tool_formats``); its arguments then stream as
they come and end where their JSON object closes. A call cut off by the end of the text keeps the
arguments it got (the finish reason says why). An opening that goes wrong after its marker
(another key order, arguments that are not an object) is read whole and parsed as JSON; if that
fails, or names an unknown tool, the text is content. Whitespace that only separates calls from
each other or from content is dropped.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.text.tool_formats import FULL, PARTIAL, WHITESPACE, Opener, ToolFormat, match

@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class Arguments:
    index: int
    text: str


Event = Content | CallStart | Arguments


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text


@dataclass
class ParsedOutput:
    content: str | None  # None when there is no text outside the calls
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallParser:
    """Incremental parser of one output; ``names``: the tools it may call (None: any name)."""

    def __init__(self, fmt: ToolFormat, names: Sequence[str] | None = None):
        self.fmt = fmt
        self.names = frozenset(names) if names is not None else None
        self.num_calls = 0
        self._buf = ""
        self._state = "content"  # content | arguments | after | fallback
        self._fallback: Opener | None = None  # the opener a malformed call started with
        self._depth = 0  # in arguments: JSON nesting, string and escape state
        self._in_string = False
        self._escape = False
        self._held_ws = ""  # trailing whitespace of the content, not sent until text follows
        self._strip_leading = False  # just after a call: drop the whitespace that follows it
        self._finished = False

    # -- public --------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        """The events ``text`` (the next piece of the output) completes."""
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        """The events of what was held back, at the end of the output."""
        if self._finished:
            return []
        self._finished = True
        events = self._run(final=True)
        if self._state == "fallback":
            events += self._close_fallback(len(self._buf), len(self._buf))
        elif self._state == "content" and self._buf:
            events += self._content(self._buf)
            self._buf = ""
        self._buf = ""
        if self._held_ws and self.num_calls == 0:
            events.append(Content(self._held_ws))
        self._held_ws = ""
        return events

    # -- states --------------------------------------------------------------------------------
    def _run(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            step = getattr(self, f"_in_{self._state}")(final, events)
            if not step:
                return events

    def _in_content(self, final: bool, events: list[Event]) -> bool:
        buf, firsts = self._buf, {o.pattern[0][0] for o in self.fmt.openers}
        for i, ch in enumerate(buf):
            if ch not in firsts:
                continue
            results = [(o, match(o.pattern, buf, i, self.names)) for o in self.fmt.openers]
            full = next((m for _, m in results if m.status == FULL), None)
            if full is not None:
                events += self._content(buf[:i])
                self._held_ws = ""
                self._start_call(full.name or "", events)
                self._buf = buf[full.end:]
                self._state = "arguments"
                return True
            if not final and any(m.status == PARTIAL for _, m in results):
                events += self._content(buf[:i])
                self._buf = buf[i:]
                return False
            broken = next((o for o, m in results if m.status != FULL and m.matched >= o.marker_len > 0), None)
            if broken is not None:
                events += self._content(buf[:i])
                self._buf = buf[i:]
                self._fallback = broken
                self._state = "fallback"
                return True
        events += self._content(buf)
        self._buf = ""
        return False

    def _in_arguments(self, final: bool, events: list[Event]) -> bool:
        buf, end = self._buf, None
        for i, c in enumerate(buf):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
        taken = buf[:end] if end is not None else buf
        if taken:
            events.append(Arguments(self.num_calls - 1, taken))
        self._buf = buf[len(taken):]
        if end is None:
            return False
        self._state = "after"
        return True

    def _in_after(self, final: bool, events: list[Event]) -> bool:
        results = [(more, match(p, self._buf, 0, self.names)) for p, more in self.fmt.continuations]
        partial = any(m.status == PARTIAL for _, m in results)
        if partial and not final:
            return False
        fulls = [(more, m) for more, m in results if m.status == FULL]
        self._state = "content"
        self._strip_leading = True
        if fulls:
            more, m = max(fulls, key=lambda r: r[1].end)
            self._buf = self._buf[m.end:]
            if more:
                self._start_call(m.name or "", events)
                self._state = "arguments"
        elif partial:
            self._buf = ""  # the end of the text cut the call's closing off: nothing of it is content
        return True

    def _in_fallback(self, final: bool, events: list[Event]) -> bool:
        end_marker = self._fallback.fallback_end if self._fallback is not None else None
        if end_marker is None:
            return False  # runs to the end of the text: decided by finish()
        end = self._buf.find(end_marker)
        if end == -1:
            return False
        events += self._close_fallback(end, end + len(end_marker))
        return True

    # -- helpers -------------------------------------------------------------------------------
    def _start_call(self, name: str, events: list[Event]) -> None:
        events.append(CallStart(self.num_calls, name))
        events.append(Arguments(self.num_calls, "{"))
        self.num_calls += 1
        self._depth, self._in_string, self._escape = 1, False, False

    def _close_fallback(self, body_end: int, end: int) -> list[Event]:
        """A malformed call's text (``_buf[:end]``, its body ending at ``body_end``) as calls if it
        parses as JSON, else as content."""
        raw, self._buf = self._buf[:end], self._buf[end:]
        self._state = "content"
        assert self._fallback is not None
        calls = loose_calls(raw[len(self._fallback.pattern[0]):body_end], self.names)
        if calls is None:
            return self._content(raw)
        events: list[Event] = []
        self._held_ws = ""
        for name, arguments in calls:
            events.append(CallStart(self.num_calls, name))
            events.append(Arguments(self.num_calls, arguments))
            self.num_calls += 1
        self._strip_leading = True
        return events

    def _content(self, text: str) -> list[Event]:
        if self._strip_leading:
            text = text.lstrip(WHITESPACE)
            if not text:
                return []
            self._strip_leading = False
        body = text.rstrip(WHITESPACE)
        if not body:
            self._held_ws += text
            return []
        out = [Content(self._held_ws + body)]
        self._held_ws = text[len(body):]
        return out


def loose_calls(body: str, names: frozenset[str] | None) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of the call objects in ``body``: one object, a list of them, or objects
    separated by ";". None unless every one is a call of a known tool with object arguments."""
    body = body.strip()
    try:
        parts = [json.loads(body)]
    except ValueError:
        try:
            parts = [json.loads(p) for p in body.split(";")]
        except ValueError:
            return None
    if len(parts) == 1 and isinstance(parts[0], list):
        parts = parts[0]
    calls = []
    for p in parts:
        if not isinstance(p, dict) or not isinstance(p.get("name"), str):
            return None
        args = p.get("arguments", p.get("parameters"))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict) or (names is not None and p["name"] not in names):
            return None
        calls.append((p["name"], json.dumps(args, ensure_ascii=False)))
    return calls or None


def parse(fmt: ToolFormat, text: str, names: Sequence[str] | None = None) -> ParsedOutput:
    """The content and tool calls of a whole output."""
    parser = ToolCallParser(fmt, names)
    return collect(parser.feed(text) + parser.finish())


def collect(events: Sequence[Event]) -> ParsedOutput:
    """Events joined: the content (None if empty) and the calls."""
    content: list[str] = []
    calls: list[ToolCall] = []
    for e in events:
        if isinstance(e, Content):
            content.append(e.text)
        elif isinstance(e, CallStart):
            calls.append(ToolCall(e.name, ""))
        else:
            calls[e.index].arguments += e.text
    return ParsedOutput("".join(content) or None, calls)
