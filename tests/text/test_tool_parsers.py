"""Tool-call parsers: each format whole, malformed text as content, and streaming cut at every position."""

from __future__ import annotations

import json

import pytest

from kvserve.text.tool_formats import HERMES, LLAMA3_JSON, MAX_OPENING_CHARS, MISTRAL, detect_format
from kvserve.text.tool_parsers import Arguments, CallStart, Content, ToolCall, ToolCallParser, collect, parse

NAMES = ["get_weather", "get_time"]
W = '{"city": "Paris", "unit": "celsius"}'
T = '{"tz": "Europe/Paris"}'


def calls(*pairs: tuple[str, str]) -> list[ToolCall]:
    return [ToolCall(n, a) for n, a in pairs]


CASES = [
    # (format, text, content, calls)
    (HERMES, f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>', None,
     calls(("get_weather", W))),
    (HERMES, f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n'
             f'<tool_call>{{"name":"get_time","arguments":{T}}}</tool_call>\nDone.', "Let me check.Done.",
     calls(("get_weather", W), ("get_time", T))),
    (HERMES, f'<tool_call>{{ "name" : "get_time" ,\n "parameters" : {T} }}</tool_call>', None, calls(("get_time", T))),
    # nested objects, braces and escaped quotes inside strings
    (HERMES, '<tool_call>{"name": "get_time", "arguments": {"a": {"b": [1, {"c": "}{\\""}]}, "d": "]"}}</tool_call>',
     None, calls(("get_time", '{"a": {"b": [1, {"c": "}{\\""}]}, "d": "]"}'))),
    # another key order: read whole, parsed as JSON, arguments re-serialised
    (HERMES, '<tool_call>{"arguments": {"tz": "UTC"}, "name": "get_time"}</tool_call>', None,
     calls(("get_time", '{"tz": "UTC"}'))),
    # arguments given as a JSON string
    (HERMES, '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>', None,
     calls(("get_time", '{"tz": "UTC"}'))),
    # malformed: the text stays content
    (HERMES, "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    (HERMES, '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    (HERMES, '<tool_call>\n{"name": "get_wea', '<tool_call>\n{"name": "get_wea', []),
    (HERMES, "a < b and <tool_ca", "a < b and <tool_ca", []),
    (HERMES, "  plain answer, no calls \n", "  plain answer, no calls \n", []),
    # cut inside the arguments (max_tokens): a call with the arguments it got
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": {"city": "Par', None,
     calls(("get_weather", '{"city": "Par'))),
    # the closing tag cut off
    (HERMES, f'<tool_call>{{"name": "get_time", "arguments": {T}}}\n</tool', None, calls(("get_time", T))),
    (LLAMA3_JSON, f'{{"name": "get_weather", "parameters": {W}}}', None, calls(("get_weather", W))),
    (LLAMA3_JSON, f'<|python_tag|>{{"name": "get_weather", "parameters": {W}}}; {{"name": "get_time", '
                  f'"parameters": {T}}}', None, calls(("get_weather", W), ("get_time", T))),
    (LLAMA3_JSON, f'{{"name": "get_time", "parameters": {T}}}\nThat is all.', "That is all.",
     calls(("get_time", T))),
    (LLAMA3_JSON, 'Here: {"key": 1, "name": "x"} and {"name": "nobody", "parameters": {}}',
     'Here: {"key": 1, "name": "x"} and {"name": "nobody", "parameters": {}}', []),
    (LLAMA3_JSON, '<|python_tag|>{"parameters": {"tz": "UTC"}, "name": "get_time"}', None,
     calls(("get_time", '{"tz": "UTC"}'))),
    (LLAMA3_JSON, "<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    (MISTRAL, f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}}}, {{"name": "get_time", "arguments": {T}}}]',
     None, calls(("get_weather", W), ("get_time", T))),
    (MISTRAL, f'Sure. [TOOL_CALLS] [ {{"name": "get_time", "arguments": {T}}} ]', "Sure.", calls(("get_time", T))),
    (MISTRAL, "[TOOL_CALLS][oops", "[TOOL_CALLS][oops", []),
    (MISTRAL, '[TOOL_CALLS][{"arguments": {}, "name": "get_time"}]', None, calls(("get_time", "{}"))),
]


@pytest.mark.parametrize("fmt,text,content,want", CASES)
def test_whole_text(fmt, text, content, want):
    got = parse(fmt, text, NAMES)
    assert (got.content, got.calls) == (content, want)


@pytest.mark.parametrize("fmt,text,content,want", CASES)
def test_streaming_cut_anywhere_agrees_with_whole(fmt, text, content, want):
    """Two pieces cut at every position, and one character at a time: the same answer, and no
    event carries text another cut would not (content never shows a marker's start)."""
    whole = parse(fmt, text, NAMES)
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        parser = ToolCallParser(fmt, NAMES)
        events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
        assert collect(events) == whole, pieces
        for e in events:
            assert not (isinstance(e, Content) and e.text == ""), pieces


def test_streamed_events_come_as_soon_as_they_are_certain():
    parser = ToolCallParser(HERMES, NAMES)
    assert parser.feed("Checking <tool") == [Content("Checking")]  # the space may precede a call: held
    assert parser.feed('_call>\n{"name": "get_time", "arg') == []
    assert parser.feed('uments": {"tz"') == [CallStart(0, "get_time"), Arguments(0, "{"), Arguments(0, '"tz"')]
    assert parser.feed(': "UTC"}') == [Arguments(0, ': "UTC"}')]  # the object closed: no hold-back
    assert parser.feed("}\n</tool_call>") == []
    assert parser.feed(" ok") == [Content("ok")]
    assert parser.finish() == []


def test_a_long_false_start_is_not_held_forever():
    text = '<tool_call>{"name": "' + "x" * (MAX_OPENING_CHARS + 10)
    parser = ToolCallParser(HERMES, None)
    parser.feed(text)
    assert collect(parser.finish()).content == text
    # a bare brace (llama3_json) that never becomes a call is released once it cannot be one
    parser = ToolCallParser(LLAMA3_JSON, NAMES)
    assert collect(parser.feed('{"name"' + " " * (MAX_OPENING_CHARS + 10) + "x")).content


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL])
def test_rendered_calls_parse_back(fmt):
    pairs = [("get_weather", {"city": "Zürich", "unit": "c"}), ("get_time", {})]
    got = parse(fmt, fmt.render(pairs), NAMES)
    assert got.content is None
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == pairs
    # the constrained form (kvserve.server.tools.structural_tag) is call_begin + arguments + call_end
    one = f"{fmt.prefix}{fmt.call_begin('get_time')}{{}}{fmt.call_end}{fmt.suffix}"
    assert parse(fmt, one, NAMES).calls == calls(("get_time", "{}"))


def test_any_name_without_a_tool_list():
    assert parse(HERMES, '<tool_call>{"name": "anything", "arguments": {}}</tool_call>').calls == \
        calls(("anything", "{}"))


@pytest.mark.parametrize("template,want", [
    ("{% for m in messages %}<tool_call>{% endfor %}", HERMES),
    ("{{ '[TOOL_CALLS]' }}", MISTRAL),
    ("{%- if message.role == 'ipython' %}<|python_tag|>{% endif %}", LLAMA3_JSON),
    ("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}", None),
    (None, None),
])
def test_detect_format(template, want):
    assert detect_format(template) is want
