"""vLLM's request fields and routes through the `openai` SDK (vLLM's fields in extra_body), against
a live server: each works, streamed and not, and each bad value is a 400 naming its field.

Most tests share a server on the tiny random Llama with the embedded tokenizer (its text means
nothing, its tokens are exact); the last test runs the embedded SmolLM2, whose text means something.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from kvserve import SamplingParams
from kvserve.config import KVServeConfig, ServerConfig
from kvserve.server.engine_client import AsyncEngineClient
from kvserve.text.tokenizer import bad_words_token_ids
from server_utils import ServerThread, tiny_server

openai = pytest.importorskip("openai")

PROMPT = "The quick brown fox jumps over"
MSGS = [{"role": "user", "content": "Hi there"}]
FREE = {"ignore_eos": True}  # the random model never stops by itself


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with tiny_server(tiny_model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def oa(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    yield client
    client.close()


@pytest.fixture(scope="module")
def tok(server):
    return server.app.state.server.tokenizer


def refused(call, param: str | None, status: int = 400) -> dict:
    """``call`` fails with ``status`` and an OpenAI error naming ``param``; returns the error."""
    with pytest.raises(openai.APIStatusError) as e:
        call()
    assert e.value.status_code == status, e.value
    err = e.value.body
    assert err["param"] == param and err["message"], err
    return err


def extra(obj, name: str):
    """A field the OpenAI SDK's models do not declare (vLLM's extras)."""
    return (obj.model_extra or {}).get(name)


def completion_text(chunks) -> str:
    return "".join(c.choices[0].text for c in chunks if c.choices)


def chat_text(chunks) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


# --------------------------------------------------------------------------- structured_outputs


def test_structured_outputs_constrain_the_text(oa):
    cases = [
        ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
        ({"json": {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"],
                   "additionalProperties": False}}, lambda t: json.loads(t)["a"] in (1, 2)),
        ({"grammar": 'root ::= "ab" | "cd"'}, lambda t: t in ("ab", "cd")),
        ({"grammar": 'start: "x=" NUM ";"\nNUM: /[0-9]{1,2}/'}, lambda t: re.fullmatch("x=[0-9]{1,2};", t)),  # Lark
        ({"json_object": True}, lambda t: t.lstrip().startswith("{")),
    ]
    for spec, ok in cases:
        body = {"structured_outputs": spec, **FREE}
        r = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, extra_body=body)
        assert ok(r.choices[0].text), (spec, r.choices[0].text)
        streamed = completion_text(oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                                         stream=True, extra_body=body))
        assert streamed == r.choices[0].text
        chat = oa.chat.completions.create(model="tiny", messages=MSGS, max_tokens=40, temperature=0, extra_body=body)
        assert ok(chat.choices[0].message.content), (spec, chat.choices[0].message.content)


def test_structured_outputs_refusals_name_the_field(oa):
    def comp(stream: bool = False, **body):
        return lambda: oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, stream=stream,
                                             extra_body=body)

    # an invalid constraint was ignored (200, free text) when sent the new way; now a 400
    refused(comp(structured_outputs={"regex": "(unclosed"}), "structured_outputs")
    refused(comp(stream=True, structured_outputs={"grammar": "root ::= nothing-defined"}), "structured_outputs")
    err = refused(comp(structured_outputs={"grammar": "start: undefined_rule"}), "structured_outputs")  # Lark
    assert "Lark" in err["message"]
    refused(comp(guided_grammar='start: "a" ('), "guided_grammar")
    refused(comp(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs")
    refused(comp(structured_outputs={"regex": "a"}, guided_choice=["b"]), "structured_outputs")
    refused(comp(structured_outputs={"choice": ["a"]}, response_format={"type": "json_object"}),
            "structured_outputs")
    refused(comp(structured_outputs={}), "structured_outputs")
    refused(comp(structured_outputs={"json_object": False}), "structured_outputs")
    refused(comp(structured_outputs={"structural_tag": "{}"}), "structured_outputs")
    refused(comp(structured_outputs={"choice": "yes"}), "structured_outputs")  # a string, not a list
    refused(lambda: oa.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, extra_body={
        "structured_outputs": {"json": "{not json"}}), "structured_outputs")


# --------------------------------------------------------------------------- prompt_logprobs


def test_prompt_logprobs(oa, tok, tiny_model_dir):
    ids = tok.encode(PROMPT)
    r = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0,
                              extra_body={"prompt_logprobs": 2})
    plp = extra(r.choices[0], "prompt_logprobs")
    assert len(plp) == len(ids) and plp[0] is None
    from kvserve.llm import LLM

    want = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64).generate(
        [ids], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))[0].prompt_logprobs
    for i, entry in enumerate(plp[1:], 1):
        own = entry[str(ids[i])]  # the prompt's own token, then the top 2 (one of them, maybe)
        assert list(entry)[0] == str(ids[i]) and len(entry) in (2, 3)
        assert own["logprob"] == pytest.approx(want[i - 1].logprob, abs=1e-4)
        assert own["rank"] == want[i - 1].rank and own["decoded_token"] == tok.decode([ids[i]])
        assert {1, 2} <= {v["rank"] for v in entry.values()}

    chat = oa.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2,
                                      extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    plp, prompt_ids = extra(chat, "prompt_logprobs"), extra(chat, "prompt_token_ids")
    assert len(plp) == len(prompt_ids) and plp[0] is None
    assert all(list(e) == [str(t)] for e, t in zip(plp[1:], prompt_ids[1:]))  # top 0: the token alone

    # not streamed (vLLM's rule), 0 excepted; out of range
    refused(lambda: oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, stream=True,
                                          extra_body={"prompt_logprobs": 2}), "prompt_logprobs")
    refused(lambda: oa.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, stream=True,
                                               extra_body={"prompt_logprobs": 1}), "prompt_logprobs")
    chunks = list(oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, stream=True,
                                        extra_body={"prompt_logprobs": 0}))
    assert all(extra(c.choices[0], "prompt_logprobs") is None for c in chunks if c.choices)
    for value in (21, -1, "many"):
        refused(lambda: oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                              extra_body={"prompt_logprobs": value}), "prompt_logprobs")


# --------------------------------------------------------------------------- echo, logprobs 0


def test_echo(oa, tok):
    ids = tok.encode(PROMPT)
    plain = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, extra_body=FREE)
    echo = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=1,
                                 extra_body=FREE)
    text = echo.choices[0].text
    assert text == PROMPT + plain.choices[0].text
    lp = echo.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 6 and "".join(lp.tokens[: len(ids)]) == PROMPT
    assert lp.tokens[len(ids) :] == plain_tokens(oa)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) for v in lp.token_logprobs[1:])
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    # the prompt's logprobs are those prompt_logprobs reports
    plp = extra(oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 1})
                .choices[0], "prompt_logprobs")
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(
        [plp[i][str(ids[i])]["logprob"] for i in range(1, len(ids))], abs=1e-5)
    assert usage_of(echo) == usage_of(plain)

    # max_tokens 0: the prompt alone (OpenAI's way to score a text)
    only = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    c = only.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length" and only.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == len(ids)
    assert c.logprobs.top_logprobs[1] == {c.logprobs.tokens[1]: c.logprobs.token_logprobs[1]}
    # a prompt of token ids echoes as its text
    by_ids = oa.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0, echo=True)
    assert by_ids.choices[0].text.startswith(tok.decode(ids, skip_special_tokens=False))

    # streamed: the prompt opens each choice's first event
    chunks = list(oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                        logprobs=1, stream=True, n=2, extra_body=FREE))
    for k in (0, 1):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == k]
        assert mine[0].text.startswith(PROMPT)
        assert "".join(m.text for m in mine) == text
        assert sum((m.logprobs.tokens for m in mine), []) == lp.tokens
    only_chunks = list(oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, stream=True))
    assert completion_text(only_chunks) == PROMPT
    assert [c.choices[0].finish_reason for c in only_chunks if c.choices][-1] == "length"


def plain_tokens(oa) -> list[str]:
    """The token texts of the answer to PROMPT (6 greedy tokens), from its logprobs."""
    r = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0, extra_body=FREE)
    return r.choices[0].logprobs.tokens


def usage_of(r) -> tuple[int, int]:
    return r.usage.prompt_tokens, r.usage.completion_tokens


def test_zero_logprobs_still_give_the_sampled_tokens(oa):
    r = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0, extra_body=FREE)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]
    chunks = list(oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0,
                                        stream=True, extra_body=FREE))
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks if c.choices), []) == lp.token_logprobs

    chat = oa.chat.completions.create(model="tiny", messages=MSGS, max_tokens=5, temperature=0, logprobs=True,
                                      top_logprobs=0, extra_body=FREE)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(t.top_logprobs == [] and t.logprob <= 0 for t in content)
    no_lp = oa.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, top_logprobs=0)
    assert no_lp.choices[0].logprobs is None  # top_logprobs 0 without logprobs is no error (vLLM)


# --------------------------------------------------------------------------- chat template controls


def test_continue_final_message_and_generation_prompt(oa, server, tok):
    msgs = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello, I am"}]

    def chat(messages=msgs, stream=False, **body):
        return oa.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                          stream=stream, extra_body={"return_token_ids": True, **FREE, **body})

    refused(lambda: chat(continue_final_message=True), "continue_final_message")  # with add_generation_prompt
    refused(lambda: chat(messages=MSGS, continue_final_message=True, add_generation_prompt=False),
            "continue_final_message")
    cont = chat(continue_final_message=True, add_generation_prompt=False)
    ids = extra(cont, "prompt_token_ids")
    assert tok.decode(ids, skip_special_tokens=False).endswith("Hello, I am")  # left open: no end of turn
    tokenized = httpx.post(f"{server.url}/tokenize", json={"messages": msgs, "continue_final_message": True,
                                                           "add_generation_prompt": False}).json()
    assert tokenized["tokens"] == ids

    with_prompt = extra(chat(messages=MSGS), "prompt_token_ids")
    without = extra(chat(messages=MSGS, add_generation_prompt=False), "prompt_token_ids")
    assert with_prompt[: len(without)] == without and len(with_prompt) > len(without)
    assert tok.decode(with_prompt[len(without):], skip_special_tokens=False).endswith("assistant\n")

    # echo: the answer continues the assistant's message, which comes first in it
    echoed = chat(continue_final_message=True, add_generation_prompt=False, echo=True)
    assert echoed.choices[0].message.content == "Hello, I am" + cont.choices[0].message.content
    streamed = list(chat(continue_final_message=True, add_generation_prompt=False, echo=True, stream=True))
    assert chat_text(streamed) == echoed.choices[0].message.content


def test_any_role_goes_to_the_template(oa, server, tok):
    r = oa.chat.completions.create(model="tiny", max_tokens=2, extra_body={"return_token_ids": True},
                                   messages=[{"role": "narrator", "content": "It was night."}, *MSGS])
    assert "narrator" in tok.decode(extra(r, "prompt_token_ids"), skip_special_tokens=False)
    hf = server.app.state.server.tokenizer.hf
    template = hf.chat_template
    hf.chat_template = ("{% for m in messages %}{% if m['role'] == 'narrator' %}"
                        "{{ raise_exception('no narrators here') }}{% endif %}{{ m['content'] }}{% endfor %}")
    try:
        err = refused(lambda: oa.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "narrator", "content": "x"}]), "messages")
        assert "no narrators here" in err["message"]
    finally:
        hf.chat_template = template


# --------------------------------------------------------------------------- return_token_ids, usage


def test_return_token_ids(oa, server, tok):
    ids = tok.encode(PROMPT)
    r = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                              extra_body={"return_token_ids": True, **FREE})
    c = r.choices[0]
    assert extra(c, "prompt_token_ids") == ids
    out_ids = extra(c, "token_ids")
    assert len(out_ids) == r.usage.completion_tokens == 6 and tok.decode(out_ids) == c.text
    chunks = [ch for ch in oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True, **FREE})]
    firsts = [extra(ch.choices[0], "prompt_token_ids") for ch in chunks if ch.choices]
    assert firsts[0] == ids and all(f is None for f in firsts[1:])
    assert sum((extra(ch.choices[0], "token_ids") for ch in chunks if ch.choices), []) == out_ids

    chat = oa.chat.completions.create(model="tiny", messages=MSGS, max_tokens=6, temperature=0,
                                      extra_body={"return_token_ids": True, **FREE})
    chat_ids = extra(chat.choices[0], "token_ids")
    assert len(chat_ids) == 6 and extra(chat, "prompt_token_ids")
    parts = list(oa.chat.completions.create(model="tiny", messages=MSGS, max_tokens=6, temperature=0, stream=True,
                                            extra_body={"return_token_ids": True, **FREE}))
    assert extra(parts[0], "prompt_token_ids") == extra(chat, "prompt_token_ids")
    assert all(extra(p, "prompt_token_ids") is None for p in parts[1:])
    assert sum((extra(p.choices[0], "token_ids") or [] for p in parts if p.choices), []) == chat_ids

    # not asked for: not there, and neither are empty extras in usage
    raw = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).json()
    assert set(raw["choices"][0]) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
    assert set(raw["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
    raw = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2}).json()
    assert "prompt_token_ids" not in raw and "token_ids" not in raw["choices"][0]
    assert "speculative" not in raw["usage"]


def test_continuous_usage_stats_and_stream_options(oa):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
                                        stream_options=opts, extra_body=FREE))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    done = [c.usage.completion_tokens for c in with_choices]
    assert done == sorted(done) and done[-1] == 5
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices
    parts = list(oa.chat.completions.create(model="tiny", messages=MSGS, max_tokens=5, temperature=0, stream=True,
                                            stream_options=opts, extra_body=FREE))
    assert parts[0].usage.completion_tokens == 0 and parts[0].usage.prompt_tokens == parts[-1].usage.prompt_tokens
    assert all(p.usage is not None for p in parts)
    # include_usage alone: usage in the last chunk only
    plain = list(oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, stream=True,
                                       stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 3
    # stream_options without stream: a 400 (vLLM's rule)
    refused(lambda: oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                          stream_options={"include_usage": True}), "stream_options")
    refused(lambda: oa.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2,
                                               stream_options={"include_usage": True}), "stream_options")


# --------------------------------------------------------------------------- logit processing


def greedy_ids(oa, n: int = 8, temperature: float = 0.0, **body) -> list[int]:
    r = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=n, temperature=temperature,
                              extra_body={"return_token_ids": True, **FREE, **body})
    return extra(r.choices[0], "token_ids")


def test_logit_bias(oa, server, tok):
    free = greedy_ids(oa)
    forced = tok.encode(" the")[0]
    assert greedy_ids(oa, logit_bias={str(forced): 100}) == [forced] * 8
    assert greedy_ids(oa, logit_bias={str(free[0]): -100})[0] != free[0]
    streamed = list(oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
                                          logit_bias={str(forced): 100}, extra_body=FREE))
    assert completion_text(streamed) == tok.decode([forced] * 4)
    chat = oa.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3, temperature=0,
                                      logit_bias={str(forced): 100}, extra_body={"return_token_ids": True, **FREE})
    assert extra(chat.choices[0], "token_ids") == [forced] * 3
    vocab = server.client.vocab_size
    for bias in ({"abc": 1}, {"5": 101}, {"5": -100.5}, {str(vocab): 1}, {"-3": 1}):
        refused(lambda: oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, logit_bias=bias),
                "logit_bias")
    refused(lambda: oa.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, stream=True,
                                               logit_bias={str(vocab + 5): 1}), "logit_bias")


def test_allowed_token_ids(oa, server, tok):
    allowed = sorted(set(tok.encode(" red green blue yellow")))
    sampled = greedy_ids(oa, n=12, allowed_token_ids=allowed, temperature=1.0, seed=3)
    assert len(sampled) == 12 and set(sampled) <= set(allowed)
    vocab = server.client.vocab_size
    for bad in ([], [vocab], [-1]):
        refused(lambda: oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                              extra_body={"allowed_token_ids": bad}), "allowed_token_ids")


def contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_bad_words(oa, tok):
    free = greedy_ids(oa, n=10)
    # a word of the free answer, as its token sequences (vLLM's: as is, and after a space)
    word, seqs = next((w, s) for w in (tok.decode([t]) for t in free) if w.strip()
                      for s in [bad_words_token_ids([w], tok)] if any(contains(free, q) for q in s))
    banned = greedy_ids(oa, n=10, bad_words=[word])
    assert banned != free and not any(contains(banned, q) for q in seqs)
    streamed = list(oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                          extra_body={"bad_words": [word], **FREE}))
    assert completion_text(streamed) == tok.decode(banned)
    for bad in ([""], ["   "], ["x"] * 200, "word"):
        refused(lambda: oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                              extra_body={"bad_words": bad}), "bad_words")


def test_min_tokens(oa):
    free = greedy_ids(oa)
    i = next(i for i in range(1, len(free)) if free[i] not in free[:i])  # a token new at i
    stop = free[i]
    r = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                              extra_body={"stop_token_ids": [stop], "return_token_ids": True, **FREE})
    assert extra(r.choices[0], "token_ids") == free[: i + 1] and r.choices[0].finish_reason == "stop"
    held = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                 extra_body={"stop_token_ids": [stop], "min_tokens": 5, "return_token_ids": True,
                                             **FREE})
    got = extra(held.choices[0], "token_ids")
    assert len(got) >= max(5, i + 1) and stop not in got[:5]
    for value in (9, -1):
        refused(lambda: oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                              extra_body={"min_tokens": value}), "min_tokens")


def test_fields_that_would_change_the_answer_are_refused_not_ignored(oa):
    # (beam search is served: tests/server/test_beam_search_api.py; what it cannot honour is refused there)
    refused(lambda: oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, suffix="end"), "suffix")


# --------------------------------------------------------------------------- routes


def test_tokenize_and_detokenize(server, tok):
    url = server.url
    r = httpx.post(f"{url}/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == server.client.max_model_len
    assert r["token_strs"] == [tok.decode([t], skip_special_tokens=False) for t in r["tokens"]]
    chat = httpx.post(f"{url}/tokenize", json={"model": "tiny", "messages": MSGS}).json()
    assert chat["tokens"] == tok.apply_chat_template(MSGS) and "token_strs" not in chat
    back = httpx.post(f"{url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": PROMPT}
    for path, body, status, param in [
        ("/detokenize", {"tokens": [server.client.vocab_size]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": MSGS, "continue_final_message": True}, 400, "continue_final_message"),
        ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "model"),
        ("/detokenize", {"tokens": [1], "model": "nope"}, 404, "model"),
    ]:
        got = httpx.post(f"{url}{path}", json=body)
        assert got.status_code == status and got.json()["error"]["param"] == param, (body, got.text)


def test_models_unknown_models_and_unsupported_routes(oa, server):
    assert oa.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as e:
        oa.models.retrieve("nope")
    assert e.value.body["code"] == "model_not_found"
    err = refused(lambda: oa.completions.create(model="gpt-4", prompt="hi", max_tokens=2), "model", status=404)
    assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error"
    refused(lambda: oa.chat.completions.create(model="gpt-4", messages=MSGS, stream=True), "model", status=404)

    with pytest.raises(openai.NotFoundError) as e:
        oa.embeddings.create(model="tiny", input="hello")
    assert "not supported" in e.value.body["message"] and e.value.body["code"] == "unsupported_endpoint"
    for method, path in [("POST", "/v1/responses"), ("POST", "/v1/audio/transcriptions"),
                         ("POST", "/v1/images/generations"), ("GET", "/v1/files")]:
        r = httpx.request(method, f"{server.url}{path}", json={})
        assert r.status_code == 404, path
        assert "not supported" in r.json()["error"]["message"], r.text
    r = httpx.get(f"{server.url}/v1/nothing-here")
    assert r.status_code == 404 and "GET /v1/nothing-here" in r.json()["error"]["message"]


# --------------------------------------------------------------------------- the embedded model


@pytest.mark.e2e
def test_fields_on_the_embedded_model(embedded_hf_tokenizer):
    from kvserve.text.tokenizer import Tokenizer

    client = AsyncEngineClient(KVServeConfig.from_kwargs(dtype="float32", quantization="none", num_threads=1,
                                                         kv_cache_memory_gb=0.25, max_num_batched_tokens=256),
                               tokenizer=Tokenizer(embedded_hf_tokenizer))
    with ServerThread(client, ServerConfig(served_model_names=["smol"])) as server:
        oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        ask = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        free = oa.chat.completions.create(model="smol", messages=ask, max_tokens=8, temperature=0)
        assert "Paris" in free.choices[0].message.content
        banned = oa.chat.completions.create(model="smol", messages=ask, max_tokens=8, temperature=0,
                                            extra_body={"bad_words": ["Paris"]})
        assert "Paris" not in banned.choices[0].message.content

        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                  "required": ["city"], "additionalProperties": False}
        r = oa.chat.completions.create(model="smol", messages=ask, max_tokens=30, temperature=0,
                                       extra_body={"structured_outputs": {"json": schema}})
        assert set(json.loads(r.choices[0].message.content)) == {"city"}

        prefill = [{"role": "user", "content": "List three primary colours."},
                   {"role": "assistant", "content": "Red, blue and"}]
        cont = oa.chat.completions.create(model="smol", messages=prefill, max_tokens=6, temperature=0,
                                          extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                      "echo": True, "return_token_ids": True})
        text = cont.choices[0].message.content
        assert text.startswith("Red, blue and") and "yellow" in text.lower()
        tokens = httpx.post(f"{server.url}/tokenize", json={"messages": prefill, "continue_final_message": True,
                                                            "add_generation_prompt": False}).json()["tokens"]
        assert tokens == extra(cont, "prompt_token_ids")
        oa.close()
