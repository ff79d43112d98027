"""Per-request logit processing (logit_bias, allowed_token_ids, bad_words, min_tokens) and prompt
logprobs: on the sampler's rows, then end to end on a tiny model (plain, chunked, cached,
preempted, speculative)."""

import pytest
import torch

from conftest import hf_weights, kvserve_config, tiny_hf_model
from kvserve import SamplingParams
from kvserve.engine.request import Request
from kvserve.errors import InvalidArgumentError
from kvserve.llm import LLM
from kvserve.sampling.processors import LogitProcessing
from kvserve.sampling.sampler import Sampler

VOCAB = 97


def _req(params: SamplingParams, output: tuple[int, ...] = (), eos: tuple[int, ...] = ()) -> Request:
    r = Request("r", [1, 2, 3], params, eos_token_ids=eos)
    r.token_ids.extend(output)  # the output so far, without append_token's finishing rules
    return r


def _processed(params: SamplingParams, output: tuple[int, ...] = (), eos: tuple[int, ...] = ()) -> torch.Tensor:
    row = torch.zeros(VOCAB)
    LogitProcessing().apply(row, _req(params, output, eos))
    return row


def _banned(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(row == float("-inf")).flatten().tolist())


# --------------------------------------------------------------------------- on the sampler's rows


def test_logit_bias_moves_the_draw_but_not_the_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(1, VOCAB)
    top = int(logits.argmax())
    params = SamplingParams(temperature=0.0, logprobs=2, logit_bias={str(top): -100, "7": 100})
    tokens, lps = Sampler(torch.device("cpu"))(logits, [_req(params)])
    assert tokens == [7]
    raw = torch.log_softmax(logits[0], dim=-1)
    lp = lps["r"]
    assert lp.logprob == pytest.approx(float(raw[7]), abs=1e-6)  # the model's own distribution
    assert [t for t, _ in lp.top] == raw.topk(2).indices.tolist()
    # sampled rows of equal logits: a -100 bias leaves a token no chance, +1 multiplies its odds by e
    rows = 4000
    reqs = [_req(SamplingParams(temperature=1.0, logit_bias={10: -100.0, 3: 1.0})) for _ in range(rows)]
    drawn = torch.tensor(Sampler(torch.device("cpu"), seed=1)(torch.zeros(rows, VOCAB), reqs)[0])
    assert (drawn != 10).all()
    share = (drawn == 3).float().mean().item()
    assert abs(share - torch.e / (torch.e + VOCAB - 2)) < 0.01


def test_allowed_token_ids_are_the_only_ones_drawn():
    torch.manual_seed(1)
    logits = torch.randn(1, VOCAB) * 3
    allowed = [4, 9, 50, 60]
    greedy = Sampler(torch.device("cpu"))(logits, [_req(SamplingParams(temperature=0, allowed_token_ids=allowed))])
    assert greedy[0] == [max(allowed, key=lambda t: float(logits[0, t]))]
    reqs = [_req(SamplingParams(temperature=1.0, allowed_token_ids=allowed)) for _ in range(3000)]
    drawn = Sampler(torch.device("cpu"), seed=2)(logits.repeat(3000, 1), reqs)[0]
    assert set(drawn) <= set(allowed)
    want = torch.softmax(logits[0, allowed], dim=-1)
    got = torch.tensor([drawn.count(t) for t in allowed]) / 3000
    assert torch.allclose(got, want, atol=0.03)


def test_bad_words_ban_the_token_that_would_complete_them():
    words = [[4], [10, 11, 12]]
    params = SamplingParams(bad_words_token_ids=words)
    assert _banned(_processed(params)) == {4}  # a one-token word: always
    assert _banned(_processed(params, output=(10,))) == {4}  # the prefix is 10, 11
    assert _banned(_processed(params, output=(5, 10, 11))) == {4, 12}
    assert _banned(_processed(params, output=(10, 11, 12, 6))) == {4}
    # only the output counts: the prompt [1, 2, 3] ending a word's prefix bans nothing
    assert _banned(_processed(SamplingParams(bad_words_token_ids=[[2, 3, 8]]))) == set()


def test_min_tokens_holds_back_eos_and_stop_tokens():
    params = SamplingParams(min_tokens=3, stop_token_ids=[9], max_tokens=10)
    assert _banned(_processed(params, output=(5, 6), eos=(2,))) == {2, 9}
    assert _banned(_processed(params, output=(5, 6, 7), eos=(2,))) == set()
    ignoring = SamplingParams(min_tokens=3, stop_token_ids=[9], ignore_eos=True, max_tokens=10)
    assert _banned(_processed(ignoring, output=(), eos=(2,))) == {9}


def test_processing_comes_after_the_penalties():
    assert not SamplingParams().has_logit_processing
    assert SamplingParams(min_tokens=1).has_logit_processing
    # token 5 was seen (in the prompt): its logit 1.0 is halved by the penalty, then biased to 3.1,
    # which beats 3.0 and loses to 3.2 (bias first, or no penalty, would give other winners)
    params = SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={5: 2.6})
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 1.0
    logits[0, 6], logits[1, 6] = 3.0, 3.2
    reqs = [Request("a", [5, 1], params), Request("b", [5, 1], params)]
    assert Sampler(torch.device("cpu"))(logits, reqs)[0] == [5, 6]


@pytest.mark.parametrize("kwargs, param", [
    (dict(logit_bias={"5": 100.5}), "logit_bias"),
    (dict(logit_bias={"5": float("nan")}), "logit_bias"),
    (dict(logit_bias={"five": 1.0}), "logit_bias"),
    (dict(logit_bias={"-1": 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(bad_words=[" "]), "bad_words"),
    (dict(bad_words=["x"] * 129), "bad_words"),
    (dict(bad_words_token_ids=[[]]), "bad_words"),
])
def test_bad_values_name_their_field(kwargs, param):
    with pytest.raises(InvalidArgumentError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_bad_words_token_ids_are_made_as_vllm_makes_them(embedded_hf_tokenizer):
    from kvserve.text.tokenizer import Tokenizer, bad_words_token_ids

    tok = Tokenizer(embedded_hf_tokenizer)
    seqs = bad_words_token_ids(["hello", " world wide"], tok)
    # each word as it is, and after a space when that is another token sequence of the same length
    assert seqs[0] == tok.encode("hello", add_special_tokens=False)
    assert tok.encode(" hello", add_special_tokens=False) in seqs
    assert tok.encode("world wide", add_special_tokens=False) in seqs


# --------------------------------------------------------------------------- end to end, tiny model

_model: list = []


def tiny():
    if not _model:
        hf = tiny_hf_model()
        _model.append((hf, kvserve_config(hf), hf_weights(hf)))
    return _model[0]


def llm(**kw) -> LLM:
    _, cfg, w = tiny()
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    return LLM.from_weights(cfg, w, **kw)


PROMPT = [5, 17, 23, 42, 8, 91, 33, 12, 64, 7, 7, 19, 50, 3, 88, 21, 14, 70, 29, 36, 45, 11, 60, 9, 81, 4, 27, 38]


def hf_prompt_logprobs(prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the prompt, float32: row i is the distribution of token i + 1."""
    hf = tiny()[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_prompt_logprobs(got, prompt: list[int], n: int) -> None:
    want = hf_prompt_logprobs(prompt)
    assert got is not None and len(got) == len(prompt) - 1
    for i, lp in enumerate(got):
        row, token = want[i], prompt[i + 1]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert lp.rank == int((row > row[token]).sum()) + 1
        assert [t for t, _ in lp.top] == row.topk(n).indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(row.topk(n).values.tolist(), abs=1e-4)


@pytest.mark.parametrize("budget", [512, 8])  # the prompt in one chunk, and in chunks of 8
def test_prompt_logprobs_match_transformers(budget):
    engine = llm(max_num_batched_tokens=budget)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=3)
    out = engine.generate([PROMPT], params)[0]
    check_prompt_logprobs(out.prompt_logprobs, PROMPT, 3)
    # a cached prompt is still computed (and still right): the cache cannot give logprobs
    engine.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))
    again = engine.generate([PROMPT], params)[0]
    assert again.num_cached_tokens == 0
    check_prompt_logprobs(again.prompt_logprobs, PROMPT, 3)
    assert again.token_ids == out.token_ids
    assert engine.generate([PROMPT], SamplingParams(max_tokens=1))[0].prompt_logprobs is None


def test_prompt_logprobs_survive_preemption():
    """A pool too small for all: requests are preempted mid-prompt and recomputed; each keeps one
    full, right set of prompt logprobs."""
    prompts = [PROMPT, PROMPT[::-1], PROMPT[3:] + PROMPT[:3]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0)
    engine = llm(num_kv_blocks=2 * (len(PROMPT) + 12) // 4 + 2, max_num_batched_tokens=8)
    outs = engine.generate(prompts, params)
    assert engine.engine.scheduler.stats.num_preemptions > 0
    for p, o in zip(prompts, outs):
        check_prompt_logprobs(o.prompt_logprobs, p, 0)


def test_min_tokens_and_bad_words_end_to_end():
    engine = llm()
    free = engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
    i = next(i for i in range(1, len(free)) if free[i] not in free[:i])  # a token new at i
    stop = free[i]
    stopped = engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop]))[0]
    assert stopped.token_ids == free[: i + 1] and stopped.stop_reason == stop
    held = engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop],
                                                    min_tokens=5))[0]
    assert len(held.token_ids) >= max(5, i + 1) and stop not in held.token_ids[:5]
    # a one-token word is never produced; a two-token word changes only its second token
    one = engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                   bad_words_token_ids=[[free[0]]]))[0].token_ids
    assert free[0] not in one
    two = engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                   bad_words_token_ids=[free[:2]]))[0].token_ids
    assert two[0] == free[0] and two[1] != free[1]
    # ids the model cannot produce are refused by the engine, naming the field
    for kw, param in ((dict(logit_bias={VOCAB: 1.0}), "logit_bias"), (dict(allowed_token_ids=[3, VOCAB]),
                      "allowed_token_ids"), (dict(bad_words_token_ids=[[VOCAB]]), "bad_words")):
        with pytest.raises(InvalidArgumentError) as e:
            engine.generate([PROMPT], SamplingParams(max_tokens=2, **kw))
        assert e.value.param == param


def test_logit_processing_is_exact_under_speculative_decoding():
    """Drafts are verified against the processed distribution: the target as its own draft model
    gives exactly the tokens of plain decoding, bans and allow-lists included."""
    _, cfg, w = tiny()
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, allowed_token_ids=list(range(3, 60))),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, bad_words_token_ids=[[40], [7, 19]],
                             logit_bias={11: 2.0}, min_tokens=4)]
    prompts = [PROMPT, PROMPT[5:]]
    plain = [o.token_ids for o in llm().generate(prompts, params)]
    spec = llm(speculative_method="draft", speculative_model="in-memory", draft=(cfg, w),
               adaptive_speculation=False)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.num_accepted_tokens for o in outs) > 0
    assert all(3 <= t < 60 for t in plain[0]) and 40 not in plain[1]
