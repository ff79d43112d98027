"""use_beam_search through the `openai` SDK against a live server on the tiny random Llama: the
beams equal a reference search over Hugging Face transformers' log-probabilities, width 1 is
greedy, streamed equals whole, chat works, and what beam search cannot honour is a 400."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.beam_search import BeamSearch
from server_utils import tiny_server

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

PROMPT = "The quick brown fox jumps over"
MSGS = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with tiny_server(tiny_model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def oa(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    yield client
    client.close()


def reference_beams(model_dir, prompt: list[int], width: int, max_tokens: int, penalty: float) -> list[list[int]]:
    """The same search, each step's log-probabilities from transformers (ignore_eos: no beam ends)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    search = BeamSearch(len(prompt), width, max_tokens, frozenset(), penalty)
    with torch.no_grad():
        while not search.done:
            ids = torch.tensor([prompt + list(b.tokens) for b in search.live])
            lp = torch.log_softmax(hf(ids).logits[:, -1].float(), dim=-1)
            vals, top = lp.topk(search.candidates_per_beam, dim=-1)
            search.advance([list(zip(t.tolist(), v.tolist())) for t, v in zip(top, vals)])
    return [list(b.tokens) for b in search.best()]


def beams(oa, **kw):
    return oa.completions.create(model="tiny", prompt=PROMPT, extra_body={"use_beam_search": True,
                                 "ignore_eos": True, "return_token_ids": True, **kw.pop("extra", {})}, **kw)


@pytest.mark.parametrize("penalty", [1.0, 0.0])
def test_beams_equal_a_reference_search_over_transformers(oa, server, tiny_model_dir, penalty):
    r = beams(oa, n=3, max_tokens=5, extra={"length_penalty": penalty})
    got = [c.model_extra["token_ids"] for c in sorted(r.choices, key=lambda c: c.index)]
    prompt = r.choices[0].model_extra["prompt_token_ids"]
    assert got == reference_beams(tiny_model_dir, prompt, 3, 5, penalty)
    assert len({tuple(t) for t in got}) == 3  # distinct beams, best first
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 15 and r.usage.prompt_tokens == len(prompt)


def test_width_one_is_greedy(oa):
    beam = beams(oa, n=1, max_tokens=8).choices[0].text
    greedy = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0].text
    assert beam == greedy


def test_streamed_equals_whole_and_chat_works(oa):
    whole = beams(oa, n=2, max_tokens=4)
    chunks = list(beams(oa, n=2, max_tokens=4, stream=True))
    texts = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert texts == {c.index: c.text for c in whole.choices}
    chat = oa.chat.completions.create(model="tiny", messages=MSGS, n=2, max_completion_tokens=4,
                                      extra_body={"use_beam_search": True, "ignore_eos": True})
    assert len(chat.choices) == 2 and all(c.message.content for c in chat.choices)
    assert chat.choices[0].message.content != chat.choices[1].message.content


@pytest.mark.parametrize("kw, param", [
    ({"n": 11}, "n"),
    ({"stop": ["x"]}, "stop"),
    ({"logprobs": 2}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"extra_body": {"use_beam_search": True, "guided_regex": "[a-z]+"}}, "guided_regex"),
    ({"extra_body": {"use_beam_search": True, "min_tokens": 2}}, "min_tokens"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"extra_body": {"use_beam_search": True, "length_penalty": "long"}}, "length_penalty"),
])
def test_what_beam_search_cannot_honour_is_a_400(oa, kw, param):
    body = {"extra_body": {"use_beam_search": True}, "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(model="tiny", prompt=PROMPT, **body)
    assert e.value.body["param"] == param, e.value.body


def test_tools_with_beam_search_are_a_400(oa):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="tiny", messages=MSGS, tools=[tool], extra_body={"use_beam_search": True})
    assert e.value.body["param"] == "tools"
