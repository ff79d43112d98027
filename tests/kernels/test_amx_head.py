"""amx_head_sample (kernels/csrc/sampling/amx_head.cpp), the LM head that draws each row's token without writing
the logits: greedy rows the first largest logit and sampled rows the token ``sample_rows`` draws with the
same uniform number, over amx_linear's bf16 logits of the same weights; and the engine's use of it."""

import shutil

import pytest
import torch


@pytest.fixture(scope="module")
def amx():
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    from kvserve.kernels import load_kernels

    if not load_kernels():
        pytest.skip("native kernels did not build")
    if not torch.ops.kvserve.amx_gemm_available():
        pytest.skip("no AMX-BF16 tiles on this CPU (or KVSERVE_AMX=0)")
    return torch.ops.kvserve


def _reference(amx, x, packed, n, inv_t, u):
    """The unfused path: amx_linear's bf16 logits, then the sampler's native argmax and draw."""
    logits = amx.amx_linear(x, packed, n)
    out = torch.empty(x.shape[0], dtype=torch.long)
    greedy = inv_t == 0
    if greedy.any():
        out[greedy] = amx.argmax_rows(logits[greedy].contiguous())
    if (~greedy).any():
        out[~greedy] = amx.sample_rows(logits[~greedy].contiguous(), inv_t[~greedy].contiguous(), u[~greedy].contiguous())
    return out


# rows: under one tile, a ragged 32-row block, past a 256-row chunk; columns: whole panels, a ragged
# last panel, fewer than one; temperatures: all greedy, all sampled, mixed
@pytest.mark.parametrize("m,n,k", [(1, 100, 64), (64, 4096, 576), (37, 1000, 96), (300, 333, 64), (5, 7, 32)])
@pytest.mark.parametrize("rows", ["greedy", "sampled", "mixed"])
def test_amx_head_sample_picks_what_the_sampler_picks_from_the_written_logits(amx, m, n, k, rows):
    gen = torch.Generator().manual_seed(m * 7 + n)
    x = torch.randn(m, k, generator=gen).bfloat16()
    packed = amx.amx_pack((torch.randn(n, k, generator=gen) * 0.3).bfloat16())
    temps = {"greedy": [0.0], "sampled": [1.0, 0.5, 2.0], "mixed": [0.0, 1.0, 0.7]}[rows]
    inv_t = torch.tensor([0.0 if t == 0 else 1 / t for t in (temps * m)[:m]], dtype=torch.float32)
    u = torch.rand(m, generator=gen)
    got = amx.amx_head_sample(x, packed, n, inv_t, u)
    assert got.dtype == torch.long and got.shape == (m,)
    assert torch.equal(got, _reference(amx, x, packed, n, inv_t, u))


def test_greedy_ties_go_to_the_first_column_as_argmax_gives_them(amx):
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    w[40] = w[7]  # another panel
    w[9] = w[7]  # the same panel
    w[95] = w[7]
    x = w[7].repeat(3, 1)
    assert amx.amx_head_sample(x, amx.amx_pack(w), 96, torch.zeros(3), torch.zeros(3)).tolist() == [7, 7, 7]


def test_a_row_draws_the_same_token_in_any_batch(amx):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(70, 128, generator=gen).bfloat16()
    packed = amx.amx_pack(torch.randn(2000, 128, generator=gen).bfloat16())
    inv_t, u = torch.rand(70, generator=gen) + 0.5, torch.rand(70, generator=gen)
    inv_t[::3] = 0
    full = amx.amx_head_sample(x, packed, 2000, inv_t, u)
    assert torch.equal(amx.amx_head_sample(x[33:70], packed, 2000, inv_t[33:70], u[33:70]), full[33:70])
    assert torch.equal(amx.amx_head_sample(x[4:5], packed, 2000, inv_t[4:5], u[4:5]), full[4:5])


def test_draws_follow_the_softmax_of_the_logits(amx):
    """Many uniform numbers over one row: each token's share is its probability under softmax(logits / T)."""
    gen = torch.Generator().manual_seed(9)
    k, n, draws = 64, 40, 20000
    w = (torch.randn(n, k, generator=gen) * 0.15).bfloat16()
    x = torch.randn(1, k, generator=gen).bfloat16().repeat(draws, 1)
    inv_t = torch.full((draws,), 1 / 0.8)
    tokens = amx.amx_head_sample(x, amx.amx_pack(w), n, inv_t, torch.rand(draws, generator=gen))
    p = torch.softmax(amx.amx_linear(x[:1], amx.amx_pack(w), n).float()[0] / 0.8, dim=-1)
    share = torch.bincount(tokens, minlength=n).float() / draws
    assert (share - p).abs().max() < 4 * (p * (1 - p) / draws).sqrt().max() + 1e-3


def test_amx_head_sample_refuses_bad_arguments_with_a_clear_error(amx):
    packed = amx.amx_pack(torch.randn(32, 64).bfloat16())
    x, z = torch.randn(4, 64).bfloat16(), torch.zeros(4)
    with pytest.raises(RuntimeError, match="bfloat16"):
        amx.amx_head_sample(x.float(), packed, 32, z, z)
    with pytest.raises(RuntimeError, match="amx_pack"):
        amx.amx_head_sample(torch.randn(4, 96).bfloat16(), packed, 32, z, z)
    with pytest.raises(RuntimeError, match="inv_temp and u"):
        amx.amx_head_sample(x, packed, 32, torch.zeros(3), z)
    with pytest.raises(RuntimeError, match="inv_temp and u"):
        amx.amx_head_sample(x, packed, 32, z, z.double())
