"""The sampler's batched draw follows each row's distribution, never picks a filtered token, and
keeps a seeded request's draws independent of the batch."""

import torch

from kvserve.engine.request import Request, SamplingParams
from kvserve.sampling.sampler import Sampler, inverse_cdf_draw


def _req(rid: str, **kw) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4, **kw))


def test_inverse_cdf_draw_matches_the_distribution_and_skips_zero_mass():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0], [4.0, 0.0, 0.0, 0.0, 0.0, 4.0]])  # row 2 unnormalised
    n = 20000
    g = torch.Generator().manual_seed(0)
    tokens = inverse_cdf_draw(probs.repeat(n, 1), torch.rand(2 * n, generator=g)).view(n, 2)
    freq0 = torch.bincount(tokens[:, 0], minlength=6).float() / n
    freq1 = torch.bincount(tokens[:, 1], minlength=6).float() / n
    assert torch.allclose(freq0, probs[0], atol=0.015)
    assert torch.allclose(freq1, probs[1] / 8, atol=0.015)
    # the ends of [0, 1) land on tokens with mass
    edge = inverse_cdf_draw(probs, torch.tensor([0.0, 1.0 - 1e-7]))
    assert edge.tolist() == [1, 5]


def test_batched_draw_respects_top_k_and_follows_temperature():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]])).repeat(4000, 1)
    sampler = Sampler(torch.device("cpu"), seed=0)
    reqs = [_req(str(i), temperature=1.0, top_k=2) for i in range(4000)]
    tokens, _ = sampler(logits, reqs)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / len(tokens)
    assert freq[0] == 0 and freq[1] == 0  # outside the top 2
    assert abs(freq[3].item() - 0.4 / 0.7) < 0.03


def test_seeded_rows_draw_the_same_whatever_shares_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 1000)
    alone = Sampler(torch.device("cpu"))(logits[2:3], [_req("s", temperature=1.0, seed=7)])[0]
    crowd = [_req(str(i), temperature=0.9) for i in range(5)]
    crowd[2] = _req("s", temperature=1.0, seed=7)
    crowd[4] = _req("g", temperature=0.0)
    tokens = Sampler(torch.device("cpu"), seed=123)(logits, crowd)[0]
    assert tokens[2] == alone[0]
    assert tokens[4] == int(logits[4].argmax())


def _reference_filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The plain definition: full sort, top-k, then the smallest prefix reaching top_p of the rest."""
    vals, order = logits.sort(descending=True)
    if top_k > 0:
        vals[top_k:] = float("-inf")
    p = vals.softmax(-1)
    keep = (p.cumsum(-1) - p) < top_p
    vals = vals.masked_fill(~keep, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(0, order, vals).softmax(-1)


def test_top_k_top_p_fast_path_equals_the_full_sort():
    from kvserve.sampling.sampler import filtered_probs

    torch.manual_seed(0)
    # peaked rows (the candidates hold the top-p mass) and flat rows (they do not: the full sort)
    logits = torch.cat([torch.randn(4, 5000) * 6, torch.randn(4, 5000) * 0.1])
    settings = [(0, 0.9), (40, 1.0), (40, 0.8), (1000, 0.95), (0, 0.5), (10, 1.0), (0, 0.99), (300, 0.7)]
    reqs = [_req(str(i), temperature=1.0, top_k=k, top_p=p) for i, (k, p) in enumerate(settings)]
    together = filtered_probs(logits, reqs)  # one row needs the sort, so all take it
    for i, (k, p) in enumerate(settings):
        alone = filtered_probs(logits[i : i + 1], reqs[i : i + 1])[0]  # the candidates' path where exact
        want = _reference_filter(logits[i], k, p)
        assert torch.allclose(together[i], want, atol=1e-6), (k, p)
        assert torch.allclose(alone, want, atol=1e-6), (k, p)


def test_plain_temperature_rows_draw_natively_as_the_torch_path_does():
    from kvserve.kernels import kernels_available

    if not kernels_available():
        import pytest

        pytest.skip("native kernels not built")
    torch.manual_seed(1)
    logits = torch.randn(6, 3000) * 3
    # plain temperature rows (native on CPU), a filtered one and a greedy one share the batch
    reqs = [_req(f"p{i}", temperature=0.7 + 0.1 * i, seed=i) for i in range(4)]
    reqs += [_req("k", temperature=1.0, top_k=5, seed=9), _req("g", temperature=0.0)]
    native = Sampler(torch.device("cpu"))
    assert native.native
    torch_only = Sampler(torch.device("cpu"))
    torch_only.native = False
    for _ in range(20):  # seeded rows: the same uniforms on both sides, hence the same tokens
        assert native(logits, reqs)[0] == torch_only(logits, reqs)[0]


def test_bf16_logits_draw_what_their_float32_conversion_draws():
    # the runner hands an AMX LM head's bf16 logits over unconverted when reads_bf16 says the
    # sampler only draws natively from them; anything else is converted first
    from kvserve.kernels import kernels_available

    if not kernels_available():
        import pytest

        pytest.skip("native kernels not built")
    torch.manual_seed(2)
    logits = (torch.randn(5, 3000) * 3).bfloat16()
    plain = [_req(f"p{i}", temperature=0.8, seed=i) for i in range(3)] + [_req("g", temperature=0.0)]
    sampler, reference = Sampler(torch.device("cpu")), Sampler(torch.device("cpu"))
    assert sampler.reads_bf16(plain)
    for _ in range(10):  # seeded rows: the same uniforms on both sides
        assert sampler(logits[:4], plain)[0] == reference(logits[:4].float(), plain)[0]
    others = [_req("k", temperature=1.0, top_k=5, seed=9), _req("l", temperature=0.0, logprobs=2),
              _req("r", temperature=0.0, repetition_penalty=1.3)]
    for r in others:
        assert not sampler.reads_bf16(plain + [r])
    tokens, logprobs = sampler(logits[:3], others)  # converted first: the torch paths run as before
    assert tokens == reference(logits[:3].float(), others)[0] and "l" in logprobs
    sampler.native = False
    assert not sampler.reads_bf16(plain)
