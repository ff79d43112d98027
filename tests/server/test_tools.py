"""Function calling on /v1/chat/completions: the grammar of a call, tools in the chat template,
and the embedded SmolLM2 model through the `openai` SDK, LangChain and LiteLLM.

The model is small: tests assert the structure of answers (names, arguments that validate, finish
reasons, streamed = whole), never their wisdom.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

import httpx
import pytest
import xgrammar as xgr

from kvserve.config import PARTS, KVServeConfig, ServerConfig
from kvserve.errors import InvalidArgumentError
from kvserve.server import protocol as P
from kvserve.server.engine_client import AsyncEngineClient
from kvserve.server.tools import ToolCalling, ToolPlan, check_tool_request, structural_tag
from kvserve.structured import GrammarCache, GuidedSpec, build_tokenizer_info
from kvserve.text.tokenizer import Tokenizer
from kvserve.text.tool_formats import HERMES, LLAMA3_JSON, MISTRAL
from kvserve.text.tool_parsers import parse
from server_utils import ServerThread

jsonschema = pytest.importorskip("jsonschema")

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"]}
TIME_SCHEMA = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
               "required": ["timezone"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                            "parameters": WEATHER_SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Get the local time in a time zone",
                                         "parameters": TIME_SCHEMA}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
GEN = dict(model="smol", temperature=0, max_completion_tokens=96)


def body(**fields) -> P.ChatCompletionRequest:
    return P.ChatCompletionRequest(**{"messages": ASK, **fields})


def plan(**fields) -> ToolPlan:
    request = check_tool_request(body(**fields))
    assert request is not None
    return ToolPlan(request, HERMES)


# --------------------------------------------------------------------------- no model


@pytest.fixture(scope="module")
def grammars(embedded_hf_tokenizer):
    tok = embedded_hf_tokenizer
    cache = GrammarCache(build_tokenizer_info(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id]))
    yield cache
    cache.close()


def accepts(grammars: GrammarCache, spec: GuidedSpec, text: str) -> bool:
    m = xgr.GrammarMatcher(grammars.get_or_compile(spec))
    return m.accept_string(text) and m.is_completed()


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL])
def test_the_grammar_holds_exactly_the_allowed_calls(grammars, fmt):
    """For each format: required takes one call or several (parallel), each of a given tool with
    arguments valid for its schema, in JSON laid out as json.dumps does; a named choice takes
    one call of that function; auto takes text, calls, or both; and the parser reads them all."""
    weather = fmt.render([("get_weather", {"city": "Paris", "unit": "celsius"})])
    both = fmt.render([("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "CET"})])
    bad = [fmt.render([("get_weather", {"city": "Paris"})]),  # a required property missing
           fmt.render([("get_weather", {"city": "Paris", "unit": "kelvin"})]),  # not in the enum
           fmt.render([("get_news", {})]),  # not a tool
           "Sure, let me check."]
    request = check_tool_request(body(tools=TOOLS, tool_choice="required"))
    required = GuidedSpec("structural_tag", structural_tag(fmt, request))
    assert accepts(grammars, required, weather) and accepts(grammars, required, both)
    assert not any(accepts(grammars, required, text) for text in bad)
    single = check_tool_request(body(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    assert accepts(grammars, GuidedSpec("structural_tag", structural_tag(fmt, single)), weather)
    assert not accepts(grammars, GuidedSpec("structural_tag", structural_tag(fmt, single)), both)
    named = check_tool_request(body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}))
    spec = GuidedSpec("structural_tag", structural_tag(fmt, named))
    assert accepts(grammars, spec, fmt.render([("get_time", {"timezone": "CET"})]))
    assert not accepts(grammars, spec, weather)
    auto = GuidedSpec("structural_tag", structural_tag(fmt, check_tool_request(body(tools=TOOLS))))
    assert accepts(grammars, auto, "Sure, let me check.") and accepts(grammars, auto, both)
    assert not accepts(grammars, auto, bad[0])
    got = parse(fmt, both, ["get_weather", "get_time"])
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "CET"})]


QWEN_LIKE = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% endif %}{%- for message in messages %}{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

HISTORY = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]


def render(tok: Tokenizer, calling: ToolCalling, fields: dict) -> str:
    b = body(**fields)
    messages, tools = calling.template_inputs(b.template_messages(), calling.plan(b))
    return tok.decode(tok.apply_chat_template(messages, tools=tools), skip_special_tokens=False)


def test_tools_and_calls_reach_a_template_that_takes_them(embedded_hf_tokenizer, caplog):
    hf = embedded_hf_tokenizer
    saved = hf.chat_template
    hf.chat_template = QWEN_LIKE
    try:
        tok = Tokenizer(hf)
        with caplog.at_level(logging.INFO, logger="kvserve.server"):
            calling = ToolCalling("auto", tok)
        assert "parser hermes, detected from the chat template" in caplog.text
        assert calling.native_tools and calling.native_calls
        text = render(tok, calling, {"messages": HISTORY, "tools": TOOLS})
        assert json.dumps(WEATHER) in text and json.dumps(TIME) in text
        # the arguments went in as an object (a template writes them with tojson), not as a JSON string
        assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
        assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
        # tool_choice none: the template gets no tools (past calls still rendered)
        text = render(tok, calling, {"messages": HISTORY, "tools": TOOLS, "tool_choice": "none"})
        assert "# Tools" not in text and "<tool_response>" in text
    finally:
        hf.chat_template = saved


def test_a_template_without_tools_gets_them_described(embedded_hf_tokenizer, caplog):
    tok = Tokenizer(embedded_hf_tokenizer)  # SmolLM2-135M's template knows nothing of tools
    with caplog.at_level(logging.INFO, logger="kvserve.server"):
        calling = ToolCalling("auto", tok)
    assert "parser hermes" in caplog.text and "system message" in caplog.text
    assert not calling.native_tools
    text = render(tok, calling, {"messages": HISTORY, "tools": TOOLS})
    assert text.startswith("<|im_start|>system\n# Tools") and json.dumps(WEATHER) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' \
        in text
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in text
    assert "# Tools" not in render(tok, calling, {"messages": HISTORY})
    mistral = ToolCalling("mistral", tok)
    assert '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]' in \
        render(tok, mistral, {"messages": HISTORY, "tools": TOOLS})


def test_parser_setting(embedded_hf_tokenizer):
    tok = Tokenizer(embedded_hf_tokenizer)
    off = ToolCalling("none", tok)
    with pytest.raises(InvalidArgumentError) as e:
        off.plan(body(tools=TOOLS))
    assert e.value.param == "tools"
    assert off.plan(body(tools=TOOLS, tool_choice="none")) is None
    assert ToolCalling("llama3_json", tok).format is LLAMA3_JSON
    with pytest.raises(InvalidArgumentError):
        ServerConfig(tool_call_parser="xml")
    parser = argparse.ArgumentParser()
    KVServeConfig.add_cli_args(parser, tuple(PARTS))
    args = parser.parse_args(["--tool-call-parser", "mistral"])
    assert KVServeConfig.from_cli_args(args, tuple(PARTS)).server.tool_call_parser == "mistral"


# --------------------------------------------------------------------------- the embedded model


@pytest.fixture(scope="module")
def smol(embedded_hf_tokenizer):
    # float32 and dense weights, as in test_server.py: streamed and whole answers are compared token for token
    client = AsyncEngineClient(KVServeConfig.from_kwargs(dtype="float32", quantization="none", num_threads=1,
                                                         kv_cache_memory_gb=0.25, max_num_batched_tokens=256),
                               tokenizer=Tokenizer(embedded_hf_tokenizer))
    with ServerThread(client, ServerConfig(served_model_names=["smol"])) as server:
        yield server


@pytest.fixture(scope="module")
def oa(smol):
    import openai

    return openai.OpenAI(base_url=f"{smol.url}/v1", api_key="unused", max_retries=0)


def check_calls(choice, names=("get_weather", "get_time")) -> list[tuple[str, dict]]:
    """The calls of a choice that made some, each checked against its tool."""
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and choice.message.content is None
    out = []
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    assert len({c.id for c in calls}) == len(calls)
    return out


@pytest.mark.e2e
def test_required_and_named_calls_validate(oa):
    r = oa.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="required", logprobs=True, **GEN)
    calls = check_calls(r.choices[0])
    # usage counts the call's text: one logprob per completion token, and the tokens spell the calls
    tokens = [t.token for t in r.choices[0].logprobs.content]
    assert r.usage.completion_tokens == len(tokens)
    assert all(json.dumps(args, ensure_ascii=False) in "".join(tokens) for _, args in calls)

    named = oa.chat.completions.create(messages=ASK, tools=TOOLS, **GEN,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [name for name, _ in check_calls(named.choices[0])] == ["get_time"]
    one = oa.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                     **GEN)
    assert len(check_calls(one.choices[0])) == 1


@pytest.mark.e2e
def test_none_and_auto(oa):
    plain = oa.chat.completions.create(messages=ASK, **GEN)
    none = oa.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="none", **GEN)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason != "tool_calls"
    assert none.choices[0].message.content == plain.choices[0].message.content  # tools not in the prompt
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    for ask in (ASK, [{"role": "user", "content": "Call get_time for the Europe/Paris time zone."}]):
        auto = oa.chat.completions.create(messages=ask, tools=TOOLS, **GEN)
        choice = auto.choices[0]
        if choice.message.tool_calls:
            check_calls(choice)
        else:
            assert choice.message.content and choice.finish_reason in ("stop", "length")
        if ask is ASK:
            assert auto.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools are described


def reassemble(chunks) -> tuple[str | None, list[tuple[str, str]], str, object]:
    """Content, calls (name, arguments), finish reason and usage of a streamed chat completion,
    checking each call's first delta is OpenAI's (index, id, type, name, empty arguments)."""
    content, calls, finish, usage = [], {}, None, None
    for ch in chunks:
        usage = ch.usage or usage
        if not ch.choices:
            continue
        delta = ch.choices[0].delta
        content.append(delta.content or "")
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                assert tc.function.arguments == ""
                calls[tc.index] = [tc.function.name, ""]
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index][1] += tc.function.arguments
        finish = ch.choices[0].finish_reason or finish
    assert sorted(calls) == list(range(len(calls)))
    return "".join(content) or None, [tuple(calls[i]) for i in sorted(calls)], finish, usage


@pytest.mark.e2e
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_streamed_calls_equal_the_whole_answer(oa, choice):
    whole = oa.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice=choice, **GEN)
    chunks = list(oa.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice=choice, stream=True,
                                             stream_options={"include_usage": True}, **GEN))
    content, calls, finish, usage = reassemble(chunks)
    w = whole.choices[0]
    assert content == w.message.content
    assert calls == [(c.function.name, c.function.arguments) for c in w.message.tool_calls or []]
    assert finish == w.finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens
    if choice == "required":
        assert calls and finish == "tool_calls"


@pytest.mark.e2e
def test_parallel_calls(oa):
    # even the 135M model calls get_weather once per city when asked about two (greedy, float32)
    two = [{"role": "user", "content": "What is the weather like in Paris and in Tokyo today?"}]
    whole = oa.chat.completions.create(messages=two, tools=TOOLS, tool_choice="required", **GEN)
    calls = check_calls(whole.choices[0])
    assert len(calls) >= 2 and {args["city"] for _, args in calls} >= {"Paris", "Tokyo"}
    _, streamed, finish, _ = reassemble(oa.chat.completions.create(messages=two, tools=TOOLS, tool_choice="required",
                                                                   stream=True, **GEN))
    assert [(n, json.loads(a)) for n, a in streamed] == calls and finish == "tool_calls"
    single = oa.chat.completions.create(messages=two, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                        **GEN)
    assert len(check_calls(single.choices[0])) == 1


@pytest.mark.e2e
def test_round_trip_call_result_answer(oa):
    first = oa.chat.completions.create(messages=ASK, tools=TOOLS, **GEN,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    result = json.dumps({"temperature": 18, "unit": "celsius", "sky": "sunny"})
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": result}]
    answer = oa.chat.completions.create(messages=history, tools=TOOLS, tool_choice="none", **GEN)
    a = answer.choices[0]
    assert a.message.content and a.message.tool_calls is None and a.finish_reason in ("stop", "length")
    # the call and its result are in the prompt
    bare = oa.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="none", **GEN)
    assert answer.usage.prompt_tokens > bare.usage.prompt_tokens + len(result) // 4
    # the same history, free to call again: an answer or a valid call
    again = oa.chat.completions.create(messages=history, tools=TOOLS, **GEN)
    if again.choices[0].message.tool_calls:
        check_calls(again.choices[0])
    else:
        assert again.choices[0].message.content


@pytest.mark.e2e
def test_bad_tool_requests_are_400s_naming_the_field(smol):
    chat = f"{smol.url}/v1/chat/completions"

    def fn(**f):
        return {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, **f}}

    cases = [
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "name"),
        ({"tools": [fn(name="get weather!")]}, "tools", "name"),
        ({"tools": [fn(name="x" * 65)]}, "tools", "name"),
        ({"tools": [fn(parameters=["city"])]}, "tools", "parameters"),
        ({"tools": [fn(parameters={"type": "string"})]}, "tools", "object"),
        ({"tools": [{"type": "retrieval"}]}, "tools", "type"),
        ({"tools": [fn(), fn()]}, "tools", "twice"),
        ({"tools": {"name": "f"}}, "tools", "tools"),
        ({"tools": [fn(parameters={"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}})]},
         "tools", "tool schema"),
        ({"tools": [fn(parameters={"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}})],
          "stream": True}, "tools", "tool schema"),
        ({"tools": [fn()], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "'g'"),
        ({"tools": [fn()], "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
        ({"tools": [fn()], "tool_choice": {"type": "function"}}, "tool_choice", "function"),
        ({"tool_choice": "auto"}, "tool_choice", "tools"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"tools": [fn()], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
         "one output constraint"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]}, "messages",
         "function"),
    ]
    for extra, param, words in cases:
        r = httpx.post(chat, json={"messages": ASK, "max_tokens": 4, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], (extra, err)
    # auto with another constraint: that one wins, calls are still parsed
    r = httpx.post(chat, json={"messages": ASK, "max_tokens": 8, "tools": [fn()], "guided_choice": ["yes", "no"]},
                   timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("yes", "no")


@pytest.mark.e2e
def test_langchain_bind_tools_and_structured_output(smol):
    lc = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed (the `test` extra)")
    from pydantic import BaseModel, Field

    llm = lc.ChatOpenAI(model="smol", base_url=f"{smol.url}/v1", api_key="unused", temperature=0, max_tokens=96,
                        max_retries=0)
    ai = llm.bind_tools([WEATHER, TIME], tool_choice="required").invoke(ASK[0]["content"])
    assert ai.tool_calls and ai.tool_calls[0]["name"] in SCHEMAS
    jsonschema.validate(ai.tool_calls[0]["args"], SCHEMAS[ai.tool_calls[0]["name"]])

    class Person(BaseModel):
        """A person mentioned in the text."""

        name: str = Field(max_length=40)
        age: int

    person = llm.with_structured_output(Person, method="function_calling").invoke(
        "Alice is 31 years old. Who is mentioned?")
    assert isinstance(person, Person)


@pytest.mark.e2e
@pytest.mark.filterwarnings("ignore::UserWarning")  # pydantic's, about litellm's own types, at import
def test_litellm_tool_calling(smol):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import
    litellm = pytest.importorskip("litellm", reason="litellm is not installed (the `test` extra)")
    r = litellm.completion(model="openai/smol", api_base=f"{smol.url}/v1", api_key="unused", messages=ASK,
                           tools=TOOLS, tool_choice="required", temperature=0, max_tokens=96)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])
