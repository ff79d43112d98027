"""The fused CPU kernels (norms, rotary, silu*mul, gelu_tanh*mul) compute what the torch code they replace does."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from kvserve.model.layers import RMSNorm
from kvserve.model.rotary import Rotary, apply_rotary

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    from kvserve.kernels import load_kernels

    assert load_kernels()


def _norm(dtype, native):
    torch.manual_seed(0)
    n = RMSNorm(48, 1e-5)
    n.weight.data = torch.randn(48)
    n = n.to(dtype)
    n.native = native
    return n


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rms_norm_and_fused_add(dtype, tol):
    x = torch.randn(5, 48, dtype=dtype)
    d = torch.randn(5, 48, dtype=dtype)
    ref, fused = _norm(dtype, False), _norm(dtype, True)
    torch.testing.assert_close(fused(x), ref(x), atol=tol, rtol=tol)
    r1, r2 = x.clone(), x.clone()
    out_ref, out_fused = ref.add_forward(r1, d), fused.add_forward(r2, d)
    torch.testing.assert_close(r2, r1, atol=0, rtol=0)  # the residual sum is exact
    torch.testing.assert_close(out_fused, out_ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("hidden", [48, 37])  # whole vectors; a scalar tail
def test_norm_of_a_float32_stream_with_bf16_deltas_and_outputs(hidden):
    """An AMX step: the GEMMs' bf16 outputs go into the float32 residual and the norms write the bf16
    the next GEMM reads, in one pass: the same numbers as adding them widened and casting after."""
    torch.manual_seed(1)
    n = RMSNorm(hidden, 1e-5)
    n.weight.data = torch.randn(hidden)
    ref = RMSNorm(hidden, 1e-5)
    ref.weight.data = n.weight.data.clone()
    n.native = True
    x, d = torch.randn(6, hidden), torch.randn(6, hidden).bfloat16()
    r1, r2 = x.clone(), x.clone()
    want = ref.add_forward(r1, d.float()).bfloat16()
    got = n.add_forward(r2, d, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and r2.dtype == torch.float32
    torch.testing.assert_close(r2, r1, atol=0, rtol=0)  # the residual sum is exact
    assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()  # one bf16 rounding apart at most
    torch.testing.assert_close(n.add_forward(x.clone(), d), ref.add_forward(x.clone(), d.float()), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(n(x, torch.bfloat16), ref(x).bfloat16(), atol=2e-2, rtol=2e-2)
    assert n.add_forward(x.clone(), None).dtype == torch.float32  # no delta: the norm alone
    # out_rows: the GEMM's padded input, zeros past the rows
    for norm in (n, ref):
        padded = norm.add_forward(x.clone(), d, torch.bfloat16, 8)
        assert padded.shape == (8, hidden) and not padded[6:].any()
        torch.testing.assert_close(padded[:6], norm.add_forward(x.clone(), d, torch.bfloat16), atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="out_dtype"):
        torch.ops.kvserve.rms_norm(x.bfloat16(), n.weight.bfloat16(), 1e-5, torch.float32)
    with pytest.raises(RuntimeError, match="delta"):
        torch.ops.kvserve.add_rms_norm(x, d.float().double(), n.weight, 1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_rotary_in_place_on_strided_q_and_k(dtype, tol):
    rot = Rotary(16, 64, 10000.0, None)
    positions = torch.tensor([0, 5, 6, 63, 7])
    qkv = torch.randn(5, (4 + 2 + 2) * 16, dtype=dtype)  # q, k, v side by side, as the fused projection makes them
    q, k, _ = qkv.split([64, 32, 32], dim=-1)
    q, k = q.view(5, 4, 16), k.view(5, 2, 16)
    cos, sin = rot.tables(positions, dtype)
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    got_q, got_k = rot.for_step(positions, dtype, native=True).apply(q, k)
    torch.testing.assert_close(got_q, want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(got_k, want_k, atol=tol, rtol=tol)
    assert got_q.data_ptr() == q.data_ptr()  # in place, inside the projection's output


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_silu_mul(dtype, tol):
    gu = torch.randn(7, 2 * 40, dtype=dtype) * 4
    want = F.silu(gu[:, :40]) * gu[:, 40:]
    torch.testing.assert_close(torch.ops.kvserve.silu_mul(gu), want, atol=tol, rtol=tol)


def test_silu_mul_bf16_vector_rows():
    """The vector path in bf16 (an AMX prefill's MLP): rows as wide as the embedded model's, every
    output within one bf16 rounding of torch's, and most exactly torch's."""
    gu = (torch.randn(33, 2 * 1536) * 3).to(torch.bfloat16)
    want = F.silu(gu[:, :1536]) * gu[:, 1536:]
    got = torch.ops.kvserve.silu_mul(gu)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=8e-3)
    assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("width", [40, 1536])
def test_gelu_tanh_mul(width):
    """float32: within float32 rounding of GELU-tanh in float64 (closer than torch's float32 form, whose
    1 + tanh cancels for negative gates), and of torch's; vector rows and the scalar tail."""
    g = torch.Generator().manual_seed(width)
    gu = torch.randn(7, 2 * width, generator=g) * 4
    gu[0, :12] = torch.tensor([-30.0, -12.0, -6.0, -3.0, -1e-3, 0.0, 1e-3, 3.0, 6.0, 12.0, 30.0, -0.5])
    gate, up = gu[:, :width].double(), gu[:, width:].double()
    exact = (0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3))) * up).float()
    got = torch.ops.kvserve.gelu_tanh_mul(gu)
    torch.testing.assert_close(got, exact, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got, F.gelu(gu[:, :width], approximate="tanh") * gu[:, width:], atol=2e-6, rtol=1e-5)


def test_gelu_tanh_mul_bf16_vector_rows():
    """bf16 in and out (an AMX step's Gemma MLP): within one bf16 rounding of torch's; mostly exactly
    torch's where its float32 form does not cancel (gates above -2), and the exact GELU-tanh's anywhere."""
    gu = (torch.randn(33, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    gate, up = gu[:, :1536], gu[:, 1536:]
    want = F.gelu(gate, approximate="tanh") * up
    g = gate.double()
    exact = (0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3)))).to(torch.bfloat16) * up
    got = torch.ops.kvserve.gelu_tanh_mul(gu)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=8e-3)
    assert (got == want)[gate > -2].float().mean() > 0.99
    assert (got == exact).float().mean() > 0.98


def test_native_model_forward_matches_the_torch_one():
    from conftest import hf_weights, kvserve_config, tiny_hf_model

    from kvserve.attention import SeqRows, get_attention_backend, get_kv_pool
    from kvserve.model.decoder import CausalLM
    from kvserve.runner.inputs import build_inputs

    hf = tiny_hf_model()
    cfg = kvserve_config(hf)
    outs = []
    for native in (False, True):
        model = CausalLM.from_hf_weights(cfg, hf_weights(hf), torch.float32, torch.device("cpu"))
        model.use_native_ops(native)
        pool_cls = get_kv_pool("auto")
        pool = pool_cls(pool_cls.layout_for(cfg, torch.float32, 4), 16, torch.device("cpu"))
        backend = get_attention_backend("gather-sdpa")(pool, torch.float32)
        seqs = [SeqRows([3, 4, 5, 6, 7], 0, [0, 1]), SeqRows([9, 10], 0, [2])]
        inputs = build_inputs(seqs, backend)
        outs.append(model(inputs.input_ids, inputs.positions, backend, inputs.meta, pool.layers))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,vocab", [(64, 49152), (1, 49152), (3, 7), (5, 129)])
def test_argmax_rows_is_torchs_argmax_ties_included(rows, vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(rows, vocab, generator=g)
    x[0, -1] = x.max() + 1  # the last column (the scalar tail)
    if vocab > 10:
        x[-1, 3] = x[-1, vocab // 2] = x[-1].max() + 2  # a tie: the first index wins, as in torch
    assert torch.equal(torch.ops.kvserve.argmax_rows(x), x.argmax(-1))


def _torch_draw(x: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = (x / temperature.unsqueeze(1)).softmax(-1).cumsum(-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)


@pytest.mark.parametrize("rows,vocab", [(64, 49152), (3, 7), (5, 129), (2, 1)])
def test_sample_rows_is_the_inverse_cdf_draw_of_softmax_over_temperature(rows, vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(rows, vocab, generator=g) * 2
    temperature = torch.rand(rows, generator=g) + 0.3
    u = torch.rand(rows, generator=g)
    got = torch.ops.kvserve.sample_rows(x, 1 / temperature, u)
    assert torch.equal(got, _torch_draw(x, temperature, u).clamp(max=vocab - 1))


def test_sample_rows_never_draws_a_masked_token_and_follows_the_distribution():
    n = 20000
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2] + [0.0] * 30)  # a vector block, then the tail
    x = probs.log().repeat(n, 1)  # -inf where masked
    g = torch.Generator().manual_seed(0)
    u = torch.rand(n, generator=g)
    u[:2] = torch.tensor([0.0, 1.0 - 1e-7])  # the ends of [0, 1) land on tokens with mass
    tokens = torch.ops.kvserve.sample_rows(x, torch.ones(n), u)
    assert tokens[:2].tolist() == [1, 4]
    freq = torch.bincount(tokens, minlength=probs.numel()).float() / n
    assert freq[probs == 0].sum() == 0
    assert torch.allclose(freq, probs, atol=0.015)
    # a tiny temperature is greedy; a row with no mass at all gets its first max, as argmax would
    y = torch.randn(2, 1000, generator=g)
    y[1] = float("-inf")
    assert torch.ops.kvserve.sample_rows(y, torch.tensor([1e6, 1.0]), torch.tensor([0.99, 0.5])).tolist() == [
        int(y[0].argmax()), 0]


@pytest.mark.parametrize("rows,vocab", [(64, 49152), (3, 7), (5, 129)])
def test_argmax_and_draw_read_bfloat16_logits_as_the_floats_they_hold(rows, vocab):
    # an AMX LM head's bf16 logits go to the native draws unconverted: the tokens must be those of
    # the converted float32 logits (ties included: bf16 makes many)
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(rows, vocab, generator=g) * 3).bfloat16()
    x[-1, 0] = x[-1, vocab - 1] = x[-1].max() + 1
    assert torch.equal(torch.ops.kvserve.argmax_rows(x), torch.ops.kvserve.argmax_rows(x.float()))
    assert torch.equal(torch.ops.kvserve.argmax_rows(x), x.float().argmax(-1))
    inv_t, u = 1 / (torch.rand(rows, generator=g) + 0.3), torch.rand(rows, generator=g)
    assert torch.equal(torch.ops.kvserve.sample_rows(x, inv_t, u), torch.ops.kvserve.sample_rows(x.float(), inv_t, u))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.kvserve.argmax_rows(x.half())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_rows_writes_what_index_copy_does(dtype):
    """The KV write: rows of a strided view (k of the fused qkv output) to scattered slots."""
    torch.manual_seed(2)
    qkv = torch.randn(7, 4 * 8 + 2 * 2 * 8).to(dtype)
    k = qkv[:, 32:48].view(7, 2, 8)
    slots = torch.tensor([5, 0, 19, 3, 11, 12, 7])
    want, got = torch.zeros(20, 2, 8, dtype=dtype), torch.zeros(20, 2, 8, dtype=dtype)
    want.index_copy_(0, slots, k)
    torch.ops.kvserve.store_rows_(got, slots, k)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.kvserve.store_rows_(got, torch.tensor([0, 1, 2, 3, 4, 5, 20]), k)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.kvserve.store_rows_(got, slots, k.double())
