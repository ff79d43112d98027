"""Function calling on /v1/chat/completions: ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

``ToolCalling`` (one per server) knows the model's tool-call format (``--tool-call-parser``, or
detected from the chat template) and how the template takes tools: natively (``tools=`` and
``tool_calls`` in messages) or not at all, in which case the tools are described in a system
message and past calls are written into the assistant's text in that format. ``plan`` checks a
request and makes its ``ToolPlan``: the grammar that constrains the output (an xgrammar
structural tag: exactly one call of the named function, one or more calls for ``required``, free
text with calls triggered by the format's marker for ``auto``), and the parsing of the answer into
``message.tool_calls`` or streamed ``delta.tool_calls`` (``kvserve.text.tool_parsers``).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.request import SamplingParams
from kvserve.errors import InvalidArgumentError
from kvserve.server import protocol as P
from kvserve.structured.spec import GuidedSpec
from kvserve.text.tokenizer import Tokenizer, check_unicode
from kvserve.text.tool_formats import FORMATS, HERMES, ToolFormat, detect_format
from kvserve.text.tool_parsers import Arguments, CallStart, Content, Event, ToolCallParser, parse

log = logging.getLogger("kvserve.server")

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}  # OpenAI: no parameters given


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]
    definition: dict[str, Any]  # as the request gave it, for the chat template


@dataclass(frozen=True)
class ToolRequest:
    """A request's function-calling fields, checked."""

    tools: list[Tool]
    choice: str  # none | auto | required | function
    forced: str | None  # the function tool_choice names
    parallel: bool


def check_tool_request(body: P.ChatCompletionRequest) -> ToolRequest | None:
    """The request's tools and tool choice, or None without tools; a 400 naming the field if malformed."""
    if not body.tools:
        if body.tool_choice is not None:
            raise InvalidArgumentError("tool_choice is only allowed when tools are given", param="tool_choice")
        return None
    tools: list[Tool] = []
    for i, t in enumerate(body.tools):
        tools.append(_check_tool(t, f"tools[{i}]"))
        if any(other.name == tools[-1].name for other in tools[:-1]):
            raise InvalidArgumentError(f"tools: the function name {tools[-1].name!r} is given twice", param="tools")
    tc, forced = body.tool_choice, None
    if tc is None:
        choice = "auto"
    elif isinstance(tc, str):
        if tc not in ("none", "auto", "required"):
            raise InvalidArgumentError(f"tool_choice must be none, auto, required or a function, got {tc!r}",
                                       param="tool_choice")
        choice = tc
    else:
        fn = tc.get("function")
        if tc.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidArgumentError('tool_choice must be {"type": "function", "function": {"name": ...}}',
                                       param="tool_choice")
        forced, choice = fn["name"], "function"
        if forced not in {t.name for t in tools}:
            raise InvalidArgumentError(f"tool_choice names the function {forced!r}, which is not among the tools",
                                       param="tool_choice")
    return ToolRequest(tools, choice, forced, body.parallel_tool_calls is not False)


def _check_tool(t: Any, where: str) -> Tool:
    def bad(why: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"{where}{why}", param="tools")

    if not isinstance(t, dict) or t.get("type") != "function":
        raise bad('.type must be "function"')
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise bad(".function must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise bad(f".function.name must be 1 to 64 letters, digits, underscores or dashes, got {name!r}")
    if not isinstance(fn.get("description", ""), str):
        raise bad(".function.description must be a string")
    params = fn.get("parameters")
    if params is None:
        params = EMPTY_PARAMETERS
    if not isinstance(params, dict):
        raise bad(".function.parameters must be a JSON schema object")
    if params.get("type", "object") != "object":
        raise bad(f'.function.parameters must describe an object ("type": "object"), got {params.get("type")!r}')
    try:
        check_unicode(json.dumps(t, ensure_ascii=False), where, "tools")
    except RecursionError:
        raise bad(" nests too deeply") from None
    return Tool(name, params, {"type": "function", "function": {**fn, "parameters": params}})


class ToolCalling:
    """The server's function calling: the format, and how the chat template takes tools."""

    def __init__(self, setting: str, tokenizer: Tokenizer):
        template = getattr(tokenizer.hf, "chat_template", None) or ""
        text = "\n".join(template.values()) if isinstance(template, dict) else str(template)
        self.enabled = setting != "none"
        detected = detect_format(text)
        self.format: ToolFormat = FORMATS[setting] if setting in FORMATS else detected or HERMES
        self.native_tools = "tools" in text  # the template renders the tools itself
        self.native_calls = "tool_calls" in text  # ... and the calls of past assistant turns
        if not self.enabled:
            log.info("tool calls: off (--tool-call-parser none)")
        elif setting in FORMATS:
            log.info("tool calls: parser %s (--tool-call-parser)", self.format.name)
        elif detected is not None:
            log.info("tool calls: parser %s, detected from the chat template", self.format.name)
        else:
            log.info("tool calls: parser %s; the chat template shows no tool-call format%s", self.format.name,
                     "" if self.native_tools else ", so kvserve describes the tools in a system message")

    def plan(self, body: P.ChatCompletionRequest) -> ToolPlan | None:
        """The request's tool plan; None when it calls no tools (no tools, or tool_choice none)."""
        request = check_tool_request(body)
        if request is None or request.choice == "none":
            return None
        if not self.enabled:
            raise InvalidArgumentError("this server does not call tools (--tool-call-parser none)",
                                       param="tools" if body.tool_choice is None else "tool_choice")
        return ToolPlan(request, self.format)

    def template_inputs(self, messages: list[dict[str, Any]],
                        plan: ToolPlan | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and tools to render with the chat template. Arguments of past calls become
        objects, as templates expect; a template without tool support gets them written out."""
        out = []
        for m in messages:
            calls = m.get("tool_calls")
            if calls:
                calls = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
                         for c in calls]
                if self.native_calls:
                    m = {**m, "tool_calls": calls}
                else:
                    written = self.format.render([(c["function"]["name"], c["function"]["arguments"]) for c in calls])
                    m = {k: v for k, v in m.items() if k != "tool_calls"}
                    m["content"] = f"{m['content']}\n{written}" if m["content"] else written
            elif m["role"] == "tool" and not self.native_calls:
                m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            out.append(m)
        if plan is None:
            return out, None
        if self.native_tools:
            return out, [t.definition for t in plan.request.tools]
        return _with_tools_described(out, plan), None


def _arguments(text: str) -> Any:
    """A call's arguments (JSON text) as an object when they are one; templates write them with tojson."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _with_tools_described(messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    """The messages with the tools and the call format described in the system message."""
    fmt = plan.format
    example = (f'{fmt.prefix}{fmt.call_prefix}{{"name": <function-name>, "{fmt.arg_key}": <args-json-object>'
               f"{fmt.call_end}{fmt.suffix}")
    signatures = "\n".join(json.dumps(t.definition, ensure_ascii=False) for t in plan.request.tools)
    text = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{signatures}\n"
            f"</tools>\n\nFor each function call, return a json object with function name and arguments:\n{example}")
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def structural_tag(fmt: ToolFormat, request: ToolRequest) -> dict[str, Any]:
    """The xgrammar structural tag the output of ``request`` must match, in ``fmt``."""
    def tag(t: Tool) -> dict[str, Any]:
        return {"type": "tag", "begin": fmt.call_begin(t.name),
                "content": {"type": "json_schema", "json_schema": t.parameters}, "end": fmt.call_end}

    def calls() -> dict[str, Any]:  # one or more (one only unless parallel), nothing between but the separator
        return {"type": "tags_with_separator", "tags": [tag(t) for t in request.tools], "separator": fmt.separator,
                "at_least_one": True, "stop_after_first": not request.parallel}

    def wrapped(inner: dict[str, Any]) -> dict[str, Any]:
        parts = [*([{"type": "const_string", "value": fmt.prefix}] if fmt.prefix else []), inner,
                 *([{"type": "const_string", "value": fmt.suffix}] if fmt.suffix else [])]
        return parts[0] if len(parts) == 1 else {"type": "sequence", "elements": parts}

    if request.choice == "function":
        forced = next(t for t in request.tools if t.name == request.forced)
        shape = wrapped(tag(forced))
    elif request.choice == "required":
        shape = wrapped(calls())
    elif fmt.prefix:  # auto, calls inside one marked list
        shape = {"type": "triggered_tags", "triggers": [fmt.trigger], "stop_after_first": True,
                 "tags": [{"type": "tag", "begin": fmt.prefix, "content": calls(), "end": fmt.suffix}]}
    else:  # auto
        shape = {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": [tag(t) for t in request.tools],
                 "stop_after_first": not request.parallel}
    return {"type": "structural_tag", "format": shape}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(reason: str | None, num_calls: int) -> str | None:
    """OpenAI's finish reason: ``tool_calls`` when calls ended the answer."""
    return "tool_calls" if num_calls and reason == "stop" else reason


@dataclass
class ToolPlan:
    """One request's function calling: its grammar, and the parsing of each choice's answer."""

    request: ToolRequest
    format: ToolFormat
    guided: GuidedSpec = field(init=False)
    _parsers: dict[int, ToolCallParser] = field(default_factory=dict)  # per choice, while streaming

    def __post_init__(self) -> None:
        # compiled (and its schemas judged) by the grammar engine: errors name `tools`
        self.guided = GuidedSpec("structural_tag", structural_tag(self.format, self.request), param="tools")

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.request.tools]

    def sampling_params(self, body: P.ChatCompletionRequest) -> Callable[[int], SamplingParams]:
        """``body.sampling_params`` with the tool-call grammar. With another output constraint
        (response_format, guided_*), ``auto`` keeps that one and only parses; a forced call refuses."""
        def params(index: int) -> SamplingParams:
            p = body.sampling_params(index)
            if p.guided is None:
                p.guided = self.guided
            elif self.request.choice != "auto":
                raise InvalidArgumentError(f"tool_choice {self.request.choice} cannot be combined with "
                                           f"{p.guided.param}: ask for one output constraint at a time",
                                           param="tool_choice")
            return p

        return params

    # -- the answer ----------------------------------------------------------------------------
    def message(self, text: str, reason: str | None) -> tuple[P.ChatMessageOut, str | None]:
        """A whole answer's message and finish reason."""
        parsed = parse(self.format, text, self.names)
        calls = [P.ToolCall(id=new_call_id(), function=P.FunctionCall(name=c.name, arguments=c.arguments))
                 for c in parsed.calls]
        return P.ChatMessageOut(content=parsed.content, tool_calls=calls or None), finish_reason(reason, len(calls))

    def deltas(self, k: int, text: str, finished: bool) -> tuple[list[P.DeltaMessage], int]:
        """Choice ``k``'s deltas for its next piece of text, and its calls so far."""
        parser = self._parsers.get(k)
        if parser is None:
            parser = self._parsers[k] = ToolCallParser(self.format, self.names)
        events = parser.feed(text)
        if finished:
            events += parser.finish()
        return self._group(k, events), parser.num_calls

    def _group(self, k: int, events: list[Event]) -> list[P.DeltaMessage]:
        """Events as OpenAI's deltas: content, a call's opening (id, name, empty arguments), its
        arguments in pieces (adjacent pieces joined)."""
        out: list[P.DeltaMessage] = []
        last: Event | None = None
        for e in events:
            if isinstance(e, Content):
                if isinstance(last, Content):
                    out[-1].content = (out[-1].content or "") + e.text
                else:
                    out.append(P.DeltaMessage.model_construct(content=e.text))
            elif isinstance(e, CallStart):
                out.append(P.DeltaMessage.model_construct(tool_calls=[{
                    "index": e.index, "id": new_call_id(), "type": "function",
                    "function": {"name": e.name, "arguments": ""}}]))
            elif isinstance(e, Arguments):
                if isinstance(last, Arguments) and last.index == e.index:
                    out[-1].tool_calls[0]["function"]["arguments"] += e.text  # type: ignore[index]
                else:
                    out.append(P.DeltaMessage.model_construct(tool_calls=[{
                        "index": e.index, "function": {"arguments": e.text}}]))
            last = e
        return out
