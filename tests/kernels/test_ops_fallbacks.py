"""kvserve.kernels.ops: each torch fallback computes what its native op does, and the ops without one
raise NativeKernelsUnavailable where the kernels are off. Tolerances are test_fused_ops.py's."""

import shutil

import pytest
import torch

from kvserve.kernels import ops
from kvserve.kernels.ops import NativeKernelsUnavailable


@pytest.fixture(scope="module")
def native():
    from kvserve.kernels import load_kernels

    if shutil.which("c++") is None or not load_kernels():
        pytest.skip("the native kernels are not available")


@pytest.fixture
def kernels_off(monkeypatch):
    """The wrappers as they run where the kernels did not load."""
    monkeypatch.setattr(ops, "_loaded", False)


TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [48, 37])  # whole vectors; a scalar tail
def test_rms_norm_and_add_rms_norm(native, dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x, d = torch.randn(6, hidden, generator=g).to(dtype), torch.randn(6, hidden, generator=g).to(dtype)
    w, tol = torch.randn(hidden, generator=g).to(dtype), TOL[dtype]
    for out_rows in (0, 8):
        want, got = ops.rms_norm(x, w, 1e-5, None, out_rows, native=False), ops.rms_norm(x, w, 1e-5, None, out_rows)
        assert got.shape == want.shape == (max(6, out_rows), hidden) and got.dtype == dtype
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        r1, r2 = x.clone(), x.clone()
        want = ops.add_rms_norm(r1, d, w, 1e-5, None, out_rows, native=False)
        got = ops.add_rms_norm(r2, d, w, 1e-5, None, out_rows)
        torch.testing.assert_close(r2, r1, atol=0, rtol=0)  # the residual sum is exact
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        assert not want[6:].any() and not got[6:].any()


@pytest.mark.parametrize("hidden", [48, 37])
def test_norm_of_a_float32_stream_with_bf16_deltas_and_outputs(native, hidden):
    g = torch.Generator().manual_seed(hidden)
    x, d, w = torch.randn(6, hidden, generator=g), torch.randn(6, hidden, generator=g).bfloat16(), torch.randn(hidden, generator=g)
    r1, r2 = x.clone(), x.clone()
    want = ops.add_rms_norm(r1, d, w, 1e-5, torch.bfloat16, native=False)
    got = ops.add_rms_norm(r2, d, w, 1e-5, torch.bfloat16)
    assert got.dtype == want.dtype == torch.bfloat16 and r1.dtype == torch.float32
    torch.testing.assert_close(r2, r1, atol=0, rtol=0)
    assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()  # one bf16 rounding apart
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5, torch.bfloat16), ops.rms_norm(x, w, 1e-5, torch.bfloat16, native=False),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_rotary_in_place_on_strided_q_and_k(native, dtype, tol):
    g = torch.Generator().manual_seed(3)
    angles = torch.outer(torch.arange(64, dtype=torch.float32), torch.rand(8, generator=g))
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    positions = torch.tensor([0, 5, 6, 63, 7])
    before = torch.randn(5, (4 + 2 + 2) * 16, generator=g).to(dtype)  # q, k, v side by side, as the fused projection
    qkv = [before.clone(), before.clone()]
    q1, k1 = (t.view(5, -1, 16) for t in qkv[0].split([64, 32, 32], dim=-1)[:2])
    q2, k2 = (t.view(5, -1, 16) for t in qkv[1].split([64, 32, 32], dim=-1)[:2])
    # the fallback is the Python layers' rotation over the step's gathered tables, exactly
    c, s = cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)
    exact_q, exact_k = ops.apply_rotary(q1, c, s), ops.apply_rotary(k1, c, s)
    ops.rotary_(q1, k1, positions, cos, sin, native=False)
    ops.rotary_(q2, k2, positions, cos, sin)
    assert torch.equal(q1, exact_q) and torch.equal(k1, exact_k)
    torch.testing.assert_close(q2, q1, atol=tol, rtol=tol)
    torch.testing.assert_close(k2, k1, atol=tol, rtol=tol)
    assert torch.equal(qkv[0][:, 96:], before[:, 96:]) and torch.equal(qkv[1][:, 96:], before[:, 96:])  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [40, 1536])
def test_silu_mul(native, dtype, width):
    gu = (torch.randn(7, 2 * width, generator=torch.Generator().manual_seed(width)) * 4).to(dtype)
    torch.testing.assert_close(ops.silu_mul(gu), ops.silu_mul(gu, native=False), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [40, 1536])
def test_gelu_tanh_mul(native, dtype, width):
    gu = (torch.randn(7, 2 * width, generator=torch.Generator().manual_seed(width)) * 4).to(dtype)
    # torch's 0.5 x (1 + tanh) loses the tail of negative gates (~1e-7) to cancellation; the kernel keeps it
    tol = 5e-6 if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(ops.gelu_tanh_mul(gu), ops.gelu_tanh_mul(gu, native=False), atol=tol, rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_rows(native, dtype):
    qkv = torch.randn(7, 4 * 8 + 2 * 2 * 8, generator=torch.Generator().manual_seed(2)).to(dtype)
    k = qkv[:, 32:48].view(7, 2, 8)  # strided rows: the native path
    slots = torch.tensor([5, 0, 19, 3, 11, 12, 7])
    for x in (k, k.transpose(1, 2)):  # and a layout the kernel does not take: index_copy_
        want, got = torch.zeros(20, *x.shape[1:], dtype=dtype), torch.zeros(20, *x.shape[1:], dtype=dtype)
        ops.store_rows_(want, slots, x, native=False)
        ops.store_rows_(got, slots, x)
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(64, 4099), (3, 7)])
def test_argmax_rows_ties_included(native, dtype, rows, vocab):
    x = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 3).to(dtype)
    x[-1, 2] = x[-1, vocab - 1] = x[-1].max() + 1  # a tie: the first index wins
    assert torch.equal(ops.argmax_rows(x), ops.argmax_rows(x, native=False))
    assert torch.equal(ops.argmax_rows(x.t().contiguous().t()), ops.argmax_rows(x, native=False))  # any strides


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(64, 49152), (3, 7), (5, 129), (2, 1)])
def test_sample_rows_draws_the_same_tokens(native, dtype, rows, vocab):
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(rows, vocab, generator=g) * 2).to(dtype)
    inv_t, u = 1 / (torch.rand(rows, generator=g) + 0.3), torch.rand(rows, generator=g)
    assert torch.equal(ops.sample_rows(x, inv_t, u), ops.sample_rows(x, inv_t, u, native=False))


def test_sample_rows_edge_rows(native):
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2] + [0.0] * 30)  # masked tokens, a vector block, then the tail
    x = probs.log().repeat(4, 1)
    x[3] = float("-inf")  # no mass at all: the first max, as argmax gives it
    u = torch.tensor([0.0, 0.6, 1.0 - 1e-7, 0.5])
    inv_t = torch.tensor([1.0, 1.0, 1.0, 1.0])
    want = ops.sample_rows(x, inv_t, u)
    assert want.tolist() == [1, 3, 4, 0]
    assert torch.equal(ops.sample_rows(x, inv_t, u, native=False), want)
    y = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0))  # a tiny temperature is greedy
    assert ops.sample_rows(y, torch.tensor([1e6]), torch.tensor([0.99]), native=False).tolist() == [int(y.argmax())]


def test_the_element_wise_ops_run_their_fallbacks_where_the_kernels_are_off(kernels_off):
    g = torch.Generator().manual_seed(0)
    x, w, gu = torch.randn(3, 16, generator=g), torch.randn(16, generator=g), torch.randn(3, 32, generator=g)
    assert torch.equal(ops.rms_norm(x, w, 1e-5, torch.bfloat16, 4), ops.rms_norm(x, w, 1e-5, torch.bfloat16, 4, native=False))
    r1, r2 = x.clone(), x.clone()
    assert torch.equal(ops.add_rms_norm(r1, gu[:, :16], w, 1e-5), ops.add_rms_norm(r2, gu[:, :16], w, 1e-5, native=False))
    assert torch.equal(r1, r2)
    assert torch.equal(ops.silu_mul(gu), ops.silu_mul(gu, native=False))
    assert torch.equal(ops.gelu_tanh_mul(gu), ops.gelu_tanh_mul(gu, native=False))
    assert torch.equal(ops.argmax_rows(gu), gu.argmax(-1))
    inv_t, u = torch.ones(3), torch.rand(3, generator=g)
    assert torch.equal(ops.sample_rows(gu, inv_t, u), ops.sample_rows(gu, inv_t, u, native=False))
    cos, sin = torch.rand(8, 4, generator=g), torch.rand(8, 4, generator=g)
    q, k, positions = torch.randn(3, 2, 4, generator=g), torch.randn(3, 1, 4, generator=g), torch.tensor([1, 2, 7])
    want_q, want_k = q.clone(), k.clone()
    ops.rotary_(want_q, want_k, positions, cos, sin, native=False)
    ops.rotary_(q, k, positions, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    cache, want = torch.zeros(5, 1, 4), torch.zeros(5, 1, 4)
    ops.store_rows_(cache, torch.tensor([4, 0, 2]), k)
    want.index_copy_(0, torch.tensor([4, 0, 2]), k)
    assert torch.equal(cache, want)
    assert ops.amx_gemm_available() is False and ops.flash_prefill_available() is False


_t = torch.zeros(1)
RAISING = {
    "pack_quant": lambda: ops.pack_quant(_t, _t, None),
    "packed_linear": lambda: ops.packed_linear(_t, _t, "q8_0", 1),
    "dequantize_packed": lambda: ops.dequantize_packed(_t, "q8_0", 1, 1),
    "amx_pack": lambda: ops.amx_pack(_t),
    "amx_linear_max_rows": lambda: ops.amx_linear_max_rows(),
    "amx_linear": lambda: ops.amx_linear(_t, _t, 1),
    "amx_head_sample": lambda: ops.amx_head_sample(_t, _t, 1, _t, _t),
    "paged_attention": lambda: ops.paged_attention(_t, _t, _t, _t, _t, _t, 16, 1.0),
    "flash_prefill": lambda: ops.flash_prefill(_t, _t, _t, _t, _t, _t, 16, 1.0),
    "DecodeStack": lambda: ops.decode_stack(4, 2, 16, 64, 128, 1e-5),
    "lora_apply_": lambda: ops.lora_apply_(_t, _t, _t, _t, _t, _t, _t),
}


@pytest.mark.parametrize("op", sorted(RAISING))
def test_ops_without_a_fallback_raise_where_the_kernels_are_off(kernels_off, op):
    with pytest.raises(NativeKernelsUnavailable, match=op) as info:
        RAISING[op]()
    assert isinstance(info.value, RuntimeError) and info.value.op == op
