"""The Q8_0 / Q4_1 formats and their native linear kernels against a torch reference."""

import shutil

import numpy as np
import pytest
import torch

from conftest import needs_onednn_bf16
from kvserve.model.quant import QuantWeight, from_gguf_blocks, pack_q4, quantize, unpack_q4
from kvserve.model.quant_linear import AMX_MIN_ROWS, QuantLinear


@pytest.fixture(scope="module")
def kernels():
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    from kvserve.kernels import load_kernels

    if not load_kernels():
        pytest.skip("native kernels did not build")
    return torch.ops.kvserve


def test_pack_and_unpack_q4_are_inverse():
    q = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(unpack_q4(pack_q4(q)), q)


@pytest.mark.parametrize("kind", ["q8_0", "q4_1", "q4_0"])
def test_quantize_error_is_within_half_a_step(kind):
    torch.manual_seed(0)
    w = torch.randn(16, 96)
    qw = quantize(w, kind)
    assert qw.shape == w.shape
    step = qw.d.float().abs().repeat_interleave(32, dim=1)
    # q4_0's 16 levels sit asymmetrically (-8..7 steps): the far side of the extreme is a whole step off
    err = (qw.dequantize() - w).abs()
    assert (err <= step * (1.0 if kind == "q4_0" else 0.5) + 1e-3 * step + 1e-6).all()
    if kind == "q4_0":
        assert (err > step * 0.5 + 1e-3 * step).sum() <= w.numel() // 32  # at most the one clipped value a block


def test_q4_0_quantizes_as_llama_cpp_does():
    import gguf

    torch.manual_seed(3)
    w = torch.randn(6, 64)
    ref = from_gguf_blocks(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_0), "Q4_0", (6, 64))
    qw = quantize(w, "q4_0")
    # gguf-py divides by the float32 d, kvserve by its fp16 rounding: the same codes but for rare ties
    assert (qw.qs != ref.qs).float().mean() < 0.02 and torch.equal(qw.d, ref.d)


def test_quantize_refuses_k_not_a_multiple_of_32():
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize(torch.randn(4, 40), "q8_0")


def test_gguf_q4_k_becomes_q4_1_blocks_that_dequantize_as_gguf_does():
    import gguf
    import gguf.quants

    rng = np.random.default_rng(1)
    n, k = 5, 512  # two super-blocks per row
    raw = rng.integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)  # any scale and nibble bytes
    raw[..., 0:2] = np.full((n, k // 256, 1), 0.01, np.float16).view(np.uint8)  # d, dmin: finite, like a file's
    raw[..., 2:4] = np.full((n, k // 256, 1), 0.002, np.float16).view(np.uint8)
    ref = gguf.quants.dequantize(raw.reshape(n, -1), gguf.GGMLQuantizationType.Q4_K).reshape(n, k)
    qw = from_gguf_blocks(raw, "Q4_K", (n, k))
    assert qw.kind == "q4_1" and qw.shape == (n, k)
    # the sub-block scale d*sc and min dmin*mn are rounded to fp16 once: 2^-11 relative at most
    np.testing.assert_allclose(qw.dequantize().numpy(), ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())


def test_gguf_blocks_read_as_gguf_dequantizes_them():
    import gguf
    import gguf.quants

    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 64)).astype(np.float32)
    for qt in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1):
        try:
            raw = gguf.quants.quantize(w, qt)
        except NotImplementedError:
            continue  # an older gguf-py quantizes fewer types; the embedded model's test covers Q4_1
        ref = gguf.quants.dequantize(raw, qt).reshape(6, 64)
        qw = from_gguf_blocks(raw, qt.name, (6, 64))
        np.testing.assert_array_equal(qw.dequantize().numpy(), ref)


def test_q4_0_is_q4_1_with_min_minus_8d():
    torch.manual_seed(5)
    qw = quantize(torch.randn(16, 64), "q4_0")
    as41 = qw.as_q4_1()
    assert as41.kind == "q4_1" and as41.shape == qw.shape == (16, 64)
    assert torch.equal(as41.dequantize(), qw.dequantize())
    assert qw.nbytes * 10 == as41.nbytes * 9  # 18 bytes a block against 20


def test_q4_0_stays_q4_0_under_int4_and_fuses_with_q4_1_exactly():
    from kvserve.model.quant_linear import _group

    torch.manual_seed(6)
    a, b = quantize(torch.randn(8, 64), "q4_0"), quantize(torch.randn(4, 64), "q4_0")
    c = quantize(torch.randn(4, 64), "q4_1")
    assert _group("qkv", [a, b], "q4_1").kind == "q4_0"  # --quantization int4 keeps its 4.5 bits
    assert _group("qkv", [a, b], None).kind == "q4_0"
    for target in (None, "q4_1"):  # a mix fuses as q4_1, the same values
        mixed = _group("qkv", [a, c], target)
        assert mixed.kind == "q4_1"
        assert torch.equal(mixed.dequantize(), torch.cat([a.dequantize(), c.dequantize()]))


def _reference(x: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    return (x.double() @ qw.dequantize().double().T).float()


def _linear(kernels, x: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    return kernels.packed_linear(x, kernels.pack_quant(qw.qs, qw.d, qw.m), qw.kind, qw.shape[0])


@pytest.mark.parametrize("kind", ["q8_0", "q4_1", "q4_0"])
@pytest.mark.parametrize("n", [8, 13, 40])
def test_packing_keeps_every_weight(kernels, kind, n):
    torch.manual_seed(n)
    qw = quantize(torch.randn(n, 96), kind)
    packed = kernels.pack_quant(qw.qs, qw.d, qw.m)
    tiles = -(-n // 8)  # a partial last tile is padded with zero columns
    assert packed.numel() == tiles * 3 * {"q8_0": 272, "q4_1": 160, "q4_0": 144}[kind]
    assert torch.equal(kernels.dequantize_packed(packed, kind, n, 96), qw.dequantize())


@pytest.mark.parametrize("kind", ["q8_0", "q4_1", "q4_0"])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 33, 64])
@pytest.mark.parametrize("n,k", [(8, 32), (13, 64), (96, 576), (40, 1536), (4100, 64)])
def test_kernel_matches_the_dequantized_gemm(kernels, kind, m, n, k):
    torch.manual_seed(m * 1000 + n + k)
    qw = quantize(torch.randn(n, k), kind)
    x = torch.randn(m, k)
    y = _linear(kernels, x, qw)
    ref = _reference(x, qw)
    # the activations are quantized to int8 per block of 32: ~0.5-1.5% relative error measured
    assert (y - ref).norm() / ref.norm() < 0.03
    assert y.shape == (m, n)


def test_kernel_handles_zero_rows_and_zero_blocks(kernels):
    qw = quantize(torch.zeros(8, 64), "q4_1")
    assert _linear(kernels, torch.zeros(0, 64), qw).shape == (0, 8)
    assert torch.equal(_linear(kernels, torch.zeros(3, 64), qw), torch.zeros(3, 8))


def test_kernel_refuses_bad_shapes_and_kinds(kernels):
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.pack_quant(torch.zeros(4, 40, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.float16), None)
    qw = quantize(torch.randn(8, 64), "q8_0")
    packed = kernels.pack_quant(qw.qs, qw.d, qw.m)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.packed_linear(torch.randn(2, 40), packed, "q8_0", 8)
    with pytest.raises(RuntimeError, match="does not hold"):
        kernels.packed_linear(torch.randn(2, 64), packed, "q4_1", 8)  # the bytes of another format
    with pytest.raises(RuntimeError, match="does not hold"):
        kernels.packed_linear(torch.randn(2, 96), packed, "q8_0", 8)  # another K
    with pytest.raises(RuntimeError, match="unknown quantized format"):
        kernels.packed_linear(torch.randn(2, 64), packed, "q5_0", 8)


@pytest.mark.parametrize("kind", ["q8_0", "q4_1", "q4_0"])
def test_quant_linear_kernel_and_fallback_agree(kernels, kind):
    torch.manual_seed(1)
    qw = quantize(torch.randn(24, 128), kind)
    bias = torch.randn(24)
    x = torch.randn(2, 3, 128)
    fast = QuantLinear(qw, bias, torch.float32, use_kernels=True)(x)
    slow = QuantLinear(qw, bias, torch.float32, use_kernels=False)(x)
    torch.testing.assert_close(slow, torch.nn.functional.linear(x, qw.dequantize(), bias))
    assert fast.shape == slow.shape == (2, 3, 24)
    assert (fast - slow).norm() / slow.norm() < 0.03


@pytest.mark.parametrize("kind", ["q8_0", "q4_1", "q4_0"])
def test_native_dequantize_is_exact_and_prefill_rows_equal_the_same_rows_alone(kernels, kind):
    torch.manual_seed(2)
    qw = quantize(torch.randn(40, 96), kind)
    layer = QuantLinear(qw, torch.randn(40), torch.float32, use_kernels=True, amx=False)
    assert torch.equal(layer.dequantize(), qw.dequantize())
    x = torch.randn(1027, 96)  # prefill-sized: the same kernel, so each row's output is batch-invariant
    y = layer(x)
    assert torch.equal(y[:5], layer(x[:5])) and torch.equal(y[-3:], layer(x[-3:]))
    assert (y - torch.nn.functional.linear(x, qw.dequantize(), layer.bias)).norm() / y.norm() < 0.03


@pytest.mark.parametrize("kind", ["q8_0", "q4_1", "q4_0"])
@pytest.mark.parametrize("n", [13, 40, 96])
def test_every_row_gets_the_bits_it_gets_alone_whichever_tile_kernel_runs(kernels, kind, n):
    """4 rows or more run on pairs of tiles (16 columns, AVX512-VNNI builds), fewer rows and an odd or partial
    last tile on single tiles (8 columns): the same integer sums and float ops per column, the same bits."""
    torch.manual_seed(n)
    qw = quantize(torch.randn(n, 128), kind)
    packed = kernels.pack_quant(qw.qs, qw.d, qw.m)
    x = torch.randn(11, 128)
    batch = kernels.packed_linear(x, packed, kind, n)
    for i in range(11):
        assert torch.equal(kernels.packed_linear(x[i : i + 1], packed, kind, n)[0], batch[i]), i
    assert torch.equal(kernels.packed_linear(x[2:9], packed, kind, n), batch[2:9])


@pytest.mark.parametrize("kind", ["q8_0", "q4_1", "q4_0"])
@needs_onednn_bf16
def test_many_rows_take_the_bf16_gemm_where_amx_is_on_and_few_rows_the_integer_kernel(kernels, kind):
    torch.manual_seed(4)
    qw = quantize(torch.randn(40, 96), kind)
    bias = torch.randn(40)
    amx = QuantLinear(qw, bias, torch.float32, use_kernels=True, amx=True)  # (emulated bf16 off AMX: slow, same maths)
    plain = QuantLinear(qw, bias, torch.float32, use_kernels=True, amx=False)
    few = torch.randn(AMX_MIN_ROWS - 1, 96)
    assert torch.equal(amx(few), plain(few))  # below the switch: the integer kernel itself
    many = torch.randn(2, AMX_MIN_ROWS, 96)
    got = amx(many)
    want = torch.nn.functional.linear(many.bfloat16(), qw.dequantize(torch.bfloat16)).float() + bias
    assert got.shape == (2, AMX_MIN_ROWS, 40) and got.dtype == torch.float32
    assert not torch.equal(got, plain(many))  # a different GEMM ...
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # ... the bf16 one, bias added


@pytest.mark.parametrize("kind", ["q8_0", "q4_1", "q4_0"])
def test_quant_linear_decoder_fast_path_matches_the_general_one(kernels, kind):
    torch.manual_seed(3)
    qw = quantize(torch.randn(24, 128), kind)
    layer = QuantLinear(qw, None, torch.float32, use_kernels=True)
    x = torch.randn(5, 128)  # 2-D float32 without bias: straight to the kernel
    y = layer(x)
    assert torch.equal(y, layer(x.unsqueeze(0))[0])  # the general path (3-D input), the same kernel
    assert (y - torch.nn.functional.linear(x, qw.dequantize())).norm() / y.norm() < 0.03
