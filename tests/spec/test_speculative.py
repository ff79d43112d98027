"""Speculative decoding: proposers, exact verification, rollback, the adaptive policy."""

import random

import pytest
import torch

from conftest import check_every_step, hf_weights, kvserve_config, tiny_hf_model
from kvserve import SamplingParams
from kvserve.engine.request import Request
from kvserve.engine.step_cost import StepCostModel, StepFeatures
from kvserve.errors import InvalidArgumentError, ModelLoadError
from kvserve.llm import LLM
from kvserve.spec.ngram import NgramProposer
from kvserve.spec.policy import SpecPolicy, expected_tokens
from kvserve.spec.verify import verify

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

_models: dict[str, tuple] = {}


def tiny(name: str):
    """target: the model under test; other: an unrelated, smaller model with the same vocabulary."""
    if name not in _models:
        kw = dict(seed=7, layers=1, hidden=32, heads=2, kv_heads=1) if name == "other" else {}
        hf = tiny_hf_model(**kw)
        _models[name] = (kvserve_config(hf), hf_weights(hf))
    return _models[name]


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = [[rng.randrange(3, 97) for _ in range(n)] for n in (5, 17, 40, 3)]
    out.append([5, 6, 7, 8, 9] * 6)  # repetitive: prompt lookup finds its continuation
    return out


def make(method: str | None = None, draft: str | None = None, **kw) -> LLM:
    cfg, w = tiny("target")
    spec = {}
    if method == "ngram":
        spec = dict(speculative_method="ngram")
    elif method == "draft":
        spec = dict(speculative_method="draft", speculative_model="in-memory", draft=tiny(draft))
    kw.setdefault("dtype", "float32")  # exact token equality: bf16 output depends on the batch's shape
    return LLM.from_weights(cfg, w, num_kv_blocks=kw.pop("num_kv_blocks", 256), block_size=4, **spec, **kw)


_baseline: dict[str, list[list[int]]] = {}


def baseline(key: str, ps: list[list[int]], params: SamplingParams) -> list[list[int]]:
    if key not in _baseline:
        _baseline[key] = [o.token_ids for o in make().generate(ps, params)]
    return _baseline[key]


# -- proposers -------------------------------------------------------------------------------
def test_ngram_lookup_takes_the_latest_match_of_the_longest_tail():
    p = NgramProposer(min_n=1, max_n=3)
    # tail (1, 2, 3) occurs once before, followed by 4 5; tail (3,) alone also occurs later
    seq = [1, 2, 3, 4, 5, 9, 3, 8, 1, 2, 3]
    assert p.lookup(seq, 2) == [4, 5]
    assert p.lookup(seq, 10) == [4, 5, 9, 3, 8, 1, 2, 3]  # runs up to the end of the sequence
    assert p.lookup([7, 1, 7, 2, 7], 1) == [2]  # latest earlier occurrence of (7,)
    assert p.lookup([1, 2, 3, 4], 3) == []  # no earlier occurrence
    assert NgramProposer(min_n=2, max_n=2).lookup([4, 1, 9, 4, 1], 2) == [9, 4]
    assert p.lookup([1, 2, 3, 1, 2, 3], 0) == []


@pytest.mark.parametrize("method,draft", [("ngram", None), ("draft", "target"), ("draft", "other")])
@pytest.mark.parametrize("adaptive", [True, False])
def test_greedy_output_is_identical_to_no_speculation(method, draft, adaptive):
    ps = prompts()
    want = baseline("greedy", ps, GREEDY)
    llm = make(method, draft, adaptive_speculation=adaptive, max_num_batched_tokens=32)
    check_every_step(llm)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == want
    st = llm.engine.scheduler.stats.spec
    assert st.num_emitted_tokens == st.num_accepted_tokens + st.num_verifies
    assert sum(st.accepted_length_counts) == st.num_verifies
    if not adaptive:  # (adaptive drafting depends on measured step times: no counts asserted)
        assert st.num_verifies > 0
        if method == "ngram":
            assert st.num_accepted_tokens > 0  # lookup continues the repetitive prompt
        if draft == "target":
            assert st.num_accepted_tokens == st.num_draft_tokens  # the target as its own draft is always right


def test_adaptive_policy_stops_drafting_for_a_draft_model_that_is_always_wrong():
    ps = prompts()
    fixed = make("draft", "other", adaptive_speculation=False)
    fixed.generate(ps, GREEDY)
    adaptive = make("draft", "other")
    adaptive.generate(ps, GREEDY)
    f, a = fixed.engine.scheduler.stats.spec, adaptive.engine.scheduler.stats.spec
    assert f.num_accepted_tokens < f.num_draft_tokens / 10  # an unrelated model is nearly always rejected
    assert a.num_draft_tokens < f.num_draft_tokens / 4


def test_kv_accounting_stays_exact_through_rejections_preemptions_and_aborts():
    """A pool too small for the batch (preemptions), a draft model that is mostly rejected
    (rollbacks), and requests aborted mid-flight: blocks add up after every step, every
    block comes back at the end, and the survivors' outputs equal the plain baseline."""
    ps = prompts(1) + prompts(2)
    want = baseline("greedy-2", ps, GREEDY)
    llm = make("draft", "other", adaptive_speculation=False, num_kv_blocks=40, max_num_batched_tokens=64)
    check_every_step(llm)
    eng = llm.engine
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, GREEDY)
    done: dict[str, list[int]] = {}
    aborted: set[str] = set()
    steps = 0
    while eng.has_unfinished():
        for req in eng.step():
            if req.is_finished:
                done[req.request_id] = req.output_token_ids
        steps += 1
        if steps in (6, 12):  # abort one running and one waiting request
            victims = list(eng.scheduler.running)[:1] + list(eng.scheduler.waiting)[:1]
            for r in victims:
                eng.abort(r.request_id)
                aborted.add(r.request_id)
    eng.step()  # hands the last finished ids to the runner
    assert eng.scheduler.stats.num_preemptions > 0
    assert eng.scheduler.stats.spec.num_verifies > 0
    assert aborted and sorted(done) == sorted(set(map(str, range(len(ps)))) - aborted)
    for rid, toks in done.items():
        assert toks == want[int(rid)]
    kv = eng.kv
    assert kv.pool.num_free + kv.pool.num_evictable == kv.pool.num_blocks
    proposer = eng.runner.proposer
    assert not proposer.seqs and proposer.pool.num_free == proposer.pool.num_blocks


def test_stop_string_inside_a_multi_token_step_drops_the_tokens_after_it():
    from kvserve.text.output import OutputProcessor

    class Chars:  # one character per token id, enough for the output processor
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + i % 26) for i in ids)

        @property
        def backend(self):
            return self

    req = Request("r", [0, 1], SamplingParams(max_tokens=20, stop=["cd"]))
    proc = OutputProcessor(Chars())
    proc.add(req)
    for t in (1, 2, 3, 4, 5):  # one step that emitted "bcdef" at once
        req.append_token(t)
    out, stopped = proc.process(req)
    assert stopped and out.text == "b" and req.output_token_ids == [1, 2, 3]


# -- sampling stays exact --------------------------------------------------------------------
def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic, pooling the cells expected to hold fewer than 5 draws into one."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


# 99.9% quantiles of chi-square (degrees of freedom -> value): a correct sampler fails 1 in 1000
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59,
            11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70, 16: 39.25, 17: 40.79, 18: 42.31, 19: 43.82}


@pytest.mark.parametrize("draft_kind", ["point", "distribution"])
def test_rejection_rule_reproduces_the_target_distribution(draft_kind):
    """verify() on fixed target logits and a fixed draft: the first emitted token is distributed
    as the target (temperature, top-k applied), whatever the draft proposed."""
    torch.manual_seed(0)
    vocab = 8
    logits = torch.randn(2, vocab) * 1.5
    params = SamplingParams(temperature=0.8, top_k=6, max_tokens=5)
    req = Request("r", [1, 2, 3], params)
    from kvserve.sampling.sampler import filtered_probs

    target = filtered_probs(logits[:1], [req])[0]
    q = torch.softmax(torch.randn(1, vocab), dim=-1)
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(vocab)
    n = 6000
    for i in range(n):
        if draft_kind == "point":
            d, probs = int(target.argmax()), None  # a confident, deterministic proposer
        else:
            d = int(torch.multinomial(q[0], 1, generator=gen))
            probs = q
        tokens, _ = verify(logits, [d], probs, req, gen)
        counts[tokens[0]] += 1
    stat, df = chi_square(counts, target)
    assert stat < CHI2_999[df], (stat, df, counts / n, target)
    # the test has power: the same draws are far from the draft's own distribution
    if draft_kind == "distribution":
        assert chi_square(counts, q[0])[0] > 5 * CHI2_999[df]


_ref: list = []


def _ref_model():
    if not _ref:
        _ref.append(tiny_hf_model())
    return _ref[0]


@pytest.mark.parametrize("method,draft", [("ngram", None), ("draft", "other")])
def test_sampled_tokens_through_verification_follow_the_target_distribution(method, draft):
    """Engine level: many seeded requests sample tokens at temperature 1; the second comes out of
    a verify step (its draft proposed after the first). Its histogram matches the exact
    marginal computed from the reference model."""
    prompt = list(range(3, 97)) + [5, 6, 7]  # lookup finds nearly every first token earlier on
    cfg, _ = tiny("target")
    model = _ref_model()
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        seqs = torch.tensor([prompt + [t] for t in range(cfg.vocab_size)])
        p2 = torch.softmax(model(seqs).logits[:, -1].float(), dim=-1)
    want = p1 @ p2
    llm = make(method, draft, adaptive_speculation=False, max_num_seqs=64, ngram_min=1, num_kv_blocks=4096)
    n = 3000
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=i, ignore_eos=True) for i in range(n)]
    outs = llm.generate([prompt] * n, params)
    st = llm.engine.scheduler.stats.spec
    assert st.num_verifies >= n * 0.7  # most second tokens came out of verification
    counts = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=cfg.vocab_size).float()
    stat, df = chi_square(counts, want)
    assert stat < CHI2_999.get(df, 2 * df + 40), (stat, df)


# -- the adaptive policy ---------------------------------------------------------------------
def fitted_cost(fixed: float, per_row: float, per_draft: float) -> StepCostModel:
    """A step-cost model trained on synthetic steps: fixed + per_row·rows + per_draft·drafts."""
    cost = StepCostModel(forget=1.0)
    for rows in (1, 2, 4, 8, 16, 32, 64):
        cost.observe(StepFeatures(0, rows, rows * 0.5), fixed + per_row * rows)
    for rows, drafts in ((1, 3), (1, 5), (4, 8), (16, 20), (64, 64)):
        cost.observe(StepFeatures(0, rows, rows * 0.5, draft_tokens=drafts, draft_attention=drafts * 0.5),
                     fixed + per_row * rows + per_draft * drafts)
    return cost


def reqs(n: int, acceptance: float | None) -> list[Request]:
    out = []
    for i in range(n):
        r = Request(str(i), list(range(3, 515)), GREEDY)
        r.spec.acceptance = acceptance
        out.append(r)
    return out


def test_policy_drafts_the_most_alone_and_nothing_at_a_compute_bound_batch():
    # a CPU-like step: a large fixed cost (reading weights) and each extra row as costly as a decode row
    cost = fitted_cost(fixed=0.08, per_row=0.004, per_draft=0.004)
    policy = SpecPolicy(5, cost)
    assert cost.draft_seconds(512, 1) == pytest.approx(0.004, rel=0.05)
    assert set(policy.plan(reqs(1, 0.8)).values()) == {5}
    assert set(policy.plan(reqs(64, 0.3)).values()) == {0}
    assert set(policy.plan(reqs(1, 0.0)).values()) == {0}  # never accepted: not worth a row
    # the policy's choice really is the best k for a lone request at moderate acceptance
    k = policy.plan(reqs(1, 0.6))["0"]
    rate = [expected_tokens(0.6, j) / (0.084 + 0.004 * j) for j in range(6)]
    assert rate[k] == max(rate)


def test_policy_falls_back_to_plain_decoding_until_it_knows_decode_step_times():
    assert set(SpecPolicy(4, StepCostModel()).plan(reqs(2, 0.9)).values()) == {0}
    assert set(SpecPolicy(4, StepCostModel(), adaptive=False).plan(reqs(2, 0.0)).values()) == {4}


def test_acceptance_estimate_tracks_verifies_and_recovers_when_idle():
    policy = SpecPolicy(4, StepCostModel())
    r = reqs(1, None)[0]
    policy.observe(r, drafted=4, accepted=4)
    assert r.spec.acceptance == 1.0
    for _ in range(10):
        policy.observe(r, drafted=4, accepted=0)
    assert r.spec.acceptance < 0.05
    low = r.spec.acceptance
    policy.idle(r)
    assert low < r.spec.acceptance < policy.prior
    r.spec.acceptance = 0.9
    policy.idle(r)
    assert r.spec.acceptance == 0.9  # a good estimate is kept while the batch keeps k at 0


# -- configuration ---------------------------------------------------------------------------
def test_bad_speculation_settings_are_refused_with_a_clear_message():
    from kvserve.config import KVServeConfig

    with pytest.raises(InvalidArgumentError, match="--speculative-model"):
        KVServeConfig.from_kwargs(speculative_method="draft")
    with pytest.raises(InvalidArgumentError, match="only with"):
        KVServeConfig.from_kwargs(speculative_model="/x")
    with pytest.raises(InvalidArgumentError, match="num-speculative-tokens"):
        KVServeConfig.from_kwargs(speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(InvalidArgumentError, match="ngram-min"):
        KVServeConfig.from_kwargs(speculative_method="ngram", ngram_min=5, ngram_max=2)
    hf = tiny_hf_model(vocab=50)
    with pytest.raises(ModelLoadError, match="tokenizer"):
        LLM.from_weights(*tiny("target"), speculative_method="draft", speculative_model="x",
                         draft=(kvserve_config(hf), hf_weights(hf)), num_kv_blocks=16)
