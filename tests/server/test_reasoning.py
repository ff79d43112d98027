"""--reasoning-parser and chat_template_kwargs through the HTTP server.

A random model never writes ``<think>``, so these servers run over ``ScriptedClient``: an engine
client whose every request answers a known text in known pieces (the engine's deltas), and which
keeps the prompts it was given. Everything above the engine is the real server: the route, the
chat template (a Qwen3-like one that reads ``enable_thinking``), the renderers, the SSE stream.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time

import httpx
import pytest

from kvserve.bench import sse
from kvserve.config import PARTS, KVServeConfig, ServerConfig
from kvserve.engine.messages import EngineStatsSnapshot
from kvserve.errors import InvalidArgumentError
from kvserve.router.prompt import PromptTokenizer
from kvserve.server.app import create_app
from kvserve.server.kv_events import KVEventLog
from kvserve.text.output import RequestOutput
from kvserve.text.tokenizer import Tokenizer
from server_utils import AppThread

# Qwen3's way: enable_thinking false closes an empty thinking block in the prompt
QWEN3_LIKE = """{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{%- endif %}{%- if note is defined %}[note: {{ note }}]{% endif %}"""

ANSWER = "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"
REASONING, CONTENT = "\nThe user greets me.\n", "\n\nHello! How can I help?"
# the engine's deltas: cut inside both tags, and one with no text
PIECES = ["<thi", "nk>\nThe user", " greets me.\n</th", "", "ink>\n\nHello!", " How can I help?"]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Hi!"}]


class ScriptedStream:
    """One engine request that answers ``pieces`` (one token each), then finishes."""

    def __init__(self, request_id: str, prompt: list[int], pieces: list[str]):
        self.request_id, self.arrival_time, self.trace = request_id, time.monotonic(), None
        self.prompt, self.pieces, self.sent = prompt, pieces, 0

    def __aiter__(self) -> ScriptedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.sent == len(self.pieces):
            raise StopAsyncIteration
        self.sent += 1
        await asyncio.sleep(0)
        done = self.sent == len(self.pieces)
        return RequestOutput(self.request_id, self.prompt, "".join(self.pieces[:self.sent]), [0] * self.sent,
                             self.pieces[self.sent - 1], [0], done, "stop" if done else None)

    def abort(self) -> None:
        self.sent = len(self.pieces)


class ScriptedClient:
    """An engine client (kvserve.server.engine_client.EngineClient) that answers ``pieces`` to every request."""

    def __init__(self, tokenizer: Tokenizer):
        self.config = KVServeConfig()
        self.model_name, self.max_model_len, self.vocab_size = "scripted", 4096, None
        self.tokenizer = tokenizer
        self.stats, self.kv_events, self.observer = EngineStatsSnapshot(), KVEventLog(16), None
        self.is_alive, self.num_in_flight = True, 0
        self.pieces = PIECES
        self.prompts: list[list[int]] = []

    def attach(self) -> None: ...
    def shutdown(self, timeout: float = 10.0) -> None: ...
    def check_capacity(self, num_requests: int) -> None: ...
    def validate_prompt(self, prompt_token_ids: list[int]) -> None: ...
    def abort(self, request_id: str) -> None: ...

    async def fetch_state(self, timeout: float = 5.0) -> None:
        return None

    def add_request(self, prompt_token_ids: list[int], params, **kwargs) -> ScriptedStream:
        self.prompts.append(prompt_token_ids)
        return ScriptedStream(f"r{len(self.prompts)}", prompt_token_ids, list(self.pieces))


@pytest.fixture(scope="module")
def tokenizer(embedded_hf_tokenizer) -> Tokenizer:
    hf = copy.deepcopy(embedded_hf_tokenizer)  # (the session's own keeps its template)
    hf.chat_template = QWEN3_LIKE
    return Tokenizer(hf)


def serve(tokenizer: Tokenizer, reasoning_parser: str | None) -> AppThread:
    client = ScriptedClient(tokenizer)
    app = create_app(client, ServerConfig(served_model_names=["m"], reasoning_parser=reasoning_parser))
    server = AppThread(app)
    server.client = client  # type: ignore[attr-defined]
    return server


@pytest.fixture(scope="module")
def plain(tokenizer):
    with serve(tokenizer, None) as server:
        yield server


@pytest.fixture(scope="module")
def deepseek(tokenizer):
    with serve(tokenizer, "deepseek_r1") as server:
        yield server


@pytest.fixture(scope="module")
def qwen3(tokenizer):
    with serve(tokenizer, "qwen3") as server:
        yield server


def chat(server, pieces: list[str] = PIECES, **fields) -> httpx.Response:
    server.client.pieces = pieces
    return httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": ASK, **fields}, timeout=30)


def stream(server, pieces: list[str] = PIECES, **fields) -> list[dict]:
    """The chunks of a streamed chat answer ([DONE] checked and left out)."""
    server.client.pieces = pieces
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=30,
                      json={"model": "m", "messages": ASK, "stream": True, **fields}) as r:
        assert r.status_code == 200, r.read()
        events = list(sse.events(sse.lines(r.iter_text())))
    assert events[-1] == "[DONE]"
    return events[:-1]


def joined(chunks: list[dict], key: str, choice: int = 0) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks
                   if c["choices"] and c["choices"][0]["index"] == choice)


def message(r: httpx.Response, choice: int = 0) -> dict:
    assert r.status_code == 200, r.text
    return r.json()["choices"][choice]["message"]


# --------------------------------------------------------------------------- --reasoning-parser


def test_without_a_parser_nothing_changes(plain):
    msg = message(chat(plain))
    assert msg["content"] == ANSWER and "reasoning_content" not in msg and "reasoning" not in msg
    chunks = stream(plain)
    assert joined(chunks, "content") == ANSWER
    assert not any("reasoning_content" in c["choices"][0]["delta"] for c in chunks if c["choices"])


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_the_answer_is_split_into_reasoning_and_content(deepseek, qwen3, name):
    server = {"deepseek_r1": deepseek, "qwen3": qwen3}[name]
    msg = message(chat(server))
    assert (msg["reasoning_content"], msg["reasoning"], msg["content"]) == (REASONING, REASONING, CONTENT)
    # DeepSeek-R1's template opens the block in the prompt: the output starts inside it
    opened = PIECES[1:]
    opened[0] = opened[0].removeprefix("nk>")
    msg = message(chat(server, opened))
    expected = (REASONING, CONTENT) if name == "deepseek_r1" else (None, "".join(opened))
    assert (msg["reasoning_content"], msg["content"]) == expected
    # no reasoning: the fields are there, null (as vLLM sends them)
    msg = message(chat(server, ["</think>Hi"] if name == "deepseek_r1" else ["Hi"]))
    assert msg["content"] == "Hi" and msg["reasoning_content"] is None and "reasoning" in msg
    # cut off while thinking: all reasoning, no content
    msg = message(chat(server, ["<think>", "Let me see"]))
    assert (msg["reasoning_content"], msg["content"]) == ("Let me see", None)


@pytest.mark.parametrize("n", [1, 2])
def test_streamed_deltas_carry_reasoning_then_content(deepseek, n):
    chunks = stream(deepseek, n=n)
    for k in range(n):
        assert joined(chunks, "reasoning_content", k) == joined(chunks, "reasoning", k) == REASONING
        assert joined(chunks, "content", k) == CONTENT
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"] and c["choices"][0]["index"] == k]
        assert deltas[0] == {"role": "assistant", "content": ""}
        first_content = next(i for i, d in enumerate(deltas) if d.get("content") and i > 0)
        assert all("reasoning_content" not in d for d in deltas[first_content:])
        assert not any("<" in (d.get("reasoning_content") or "") for d in deltas)  # no piece of a tag leaks
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals == ["stop"] * n


def test_enable_thinking_false_is_all_content_and_reaches_the_template(qwen3):
    r = chat(qwen3, ["<think>x</think>", "Hi"], chat_template_kwargs={"enable_thinking": False})
    assert (message(r)["reasoning_content"], message(r)["content"]) == (None, "<think>x</think>Hi")
    prompt = qwen3.client.tokenizer.decode(qwen3.client.prompts[-1], skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    chunks = stream(qwen3, ["<think>x</th", "ink>Hi"], chat_template_kwargs={"enable_thinking": False})
    assert joined(chunks, "content") == "<think>x</think>Hi" and joined(chunks, "reasoning_content") == ""
    chat(qwen3, ["Hi"])
    assert qwen3.client.tokenizer.decode(qwen3.client.prompts[-1]).endswith("assistant\n")  # thinking is on


def test_tool_calls_are_read_from_the_content_only(deepseek):
    thought = "<think>I could write <tool_call> here, but not yet.</think>"
    r = chat(deepseek, [thought, CALL], tools=[WEATHER])
    msg = message(r)
    assert msg["reasoning_content"] == "I could write <tool_call> here, but not yet." and msg["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
        [("get_weather", {"city": "Paris"})]
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    pieces = [thought[:15], thought[15:-3], thought[-3:] + CALL[:20], CALL[20:]]
    chunks = stream(deepseek, pieces, tools=[WEATHER])
    assert joined(chunks, "reasoning_content") == msg["reasoning_content"] and joined(chunks, "content") == ""
    calls = [c for chunk in chunks if chunk["choices"] for c in chunk["choices"][0]["delta"].get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"


def test_the_openai_client_reads_the_reasoning(deepseek):
    import openai

    oa = openai.OpenAI(base_url=f"{deepseek.url}/v1", api_key="unused", max_retries=0)
    deepseek.client.pieces = PIECES
    r = oa.chat.completions.create(model="m", messages=ASK)
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == (REASONING, CONTENT)
    parts = [(getattr(c.choices[0].delta, "reasoning_content", None), c.choices[0].delta.content)
             for c in oa.chat.completions.create(model="m", messages=ASK, stream=True) if c.choices]
    assert "".join(r or "" for r, _ in parts) == REASONING and "".join(c or "" for _, c in parts) == CONTENT


def test_the_flag():
    assert KVServeConfig(server=ServerConfig(reasoning_parser="qwen3")).to_cli_args(tuple(PARTS)) == \
        ["--reasoning-parser", "qwen3"]  # how replicas behind the router get it
    with pytest.raises(InvalidArgumentError, match="deepseek_r1, qwen3"):
        ServerConfig(reasoning_parser="r1")



# --------------------------------------------------------------------------- chat_template_kwargs


def test_chat_template_kwargs_reach_the_template_the_tokenize_route_and_the_router(plain):
    kwargs = {"note": "from the request", "unused": [1, {"a": None}]}  # a variable no template reads is harmless
    assert chat(plain, ["Hi"], chat_template_kwargs=kwargs).status_code == 200
    prompt = plain.client.prompts[-1]
    assert plain.client.tokenizer.decode(prompt).endswith("[note: from the request]")
    tokenized = httpx.post(f"{plain.url}/tokenize", json={"messages": ASK, "chat_template_kwargs": kwargs}).json()
    assert tokenized["tokens"] == prompt
    # the router predicts the replicas' prompt (and so their prefix hashes) with the same kwargs
    router = PromptTokenizer(plain.client.tokenizer)
    try:
        body = {"model": "m", "messages": ASK, "chat_template_kwargs": kwargs}
        assert router.tokenize("chat", body) == [prompt]
        assert router.tokenize("chat", {**body, "chat_template_kwargs": None}) != [prompt]
    finally:
        router.close()


@pytest.mark.parametrize("kwargs,needle", [
    ([1, 2], "chat_template_kwargs"), ("enable_thinking=false", "chat_template_kwargs"),
    ({"tokenize": False}, "cannot set tokenize"), ({"messages": []}, "cannot set messages"),
    ({"chat_template": "{{ 1 }}"}, "cannot set chat_template"),
])
def test_bad_chat_template_kwargs_are_400s(plain, kwargs, needle):
    r = chat(plain, ["Hi"], chat_template_kwargs=kwargs)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "chat_template_kwargs"
    assert needle in error["message"]
