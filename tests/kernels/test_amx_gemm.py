"""amx_linear (kernels/csrc/gemm/amx_gemm.cpp), the decode step's bf16 GEMM on AMX tiles, against float64
sums of the same bf16 values; on CPUs without AMX, its refusal."""

import shutil

import pytest
import torch


@pytest.fixture(scope="module")
def ops():
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    from kvserve.kernels import load_kernels

    if not load_kernels():
        pytest.skip("native kernels did not build")
    return torch.ops.kvserve


@pytest.fixture(scope="module")
def amx(ops):
    if not ops.amx_gemm_available():
        pytest.skip("no AMX-BF16 tiles on this CPU (or KVSERVE_AMX=0)")
    return ops


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


# rows: under one tile, a 32-row block and a ragged one, past a 256-row chunk; columns: whole panels,
# a ragged last panel, fewer than one; inputs: one tile product, many
@pytest.mark.parametrize("m,n,k", [(1, 100, 64), (16, 576, 576), (17, 33, 1536), (64, 960, 576),
                                   (40, 7, 32), (300, 96, 128)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_sums_each_row_like_a_float64_reference(amx, m, n, k, with_bias):
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen) if with_bias else None
    y = amx.amx_linear(x, amx.amx_pack(w), n, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = _reference(x, w, bias)
    # float32 sums of exact bf16 products, then one rounding to bf16 (2^-8 relative)
    torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=1e-3 * k**0.5)


def test_amx_linear_gives_a_row_the_same_bits_in_any_batch(amx):
    """A decode's output does not depend on which rows share its step (or where it sits in a tile)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(70, 576, generator=gen).bfloat16()
    packed = amx.amx_pack(torch.randn(200, 576, generator=gen).bfloat16())
    full = amx.amx_linear(x, packed, 200)
    assert torch.equal(amx.amx_linear(x[5:6], packed, 200), full[5:6])
    assert torch.equal(amx.amx_linear(x[33:70], packed, 200), full[33:70])


def test_amx_pack_lays_out_panels_of_vnni_pairs(ops):
    """Panel p, step s, tile h, pair r, column j, element e holds W[32p + 16h + j, 32s + 2r + e];
    columns past N are zero."""
    w = torch.arange(40 * 64, dtype=torch.float32).view(40, 64)  # exact in bf16 below 256: use small values
    w = (w % 251).bfloat16()
    packed = ops.amx_pack(w).view(2, 2, 2, 16, 16, 2)
    for p, s, h, r, j, e in [(0, 0, 0, 0, 0, 0), (0, 1, 1, 3, 5, 1), (1, 0, 0, 15, 7, 0), (1, 1, 0, 2, 7, 1)]:
        assert packed[p, s, h, r, j, e] == w[32 * p + 16 * h + j, 32 * s + 2 * r + e]
    assert (packed[1, :, 0, :, 8:] == 0).all() and (packed[1, :, 1] == 0).all()  # columns 40-63


def test_amx_linear_refuses_bad_arguments_with_a_clear_error(amx):
    packed = amx.amx_pack(torch.randn(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16"):
        amx.amx_linear(torch.randn(4, 64), packed, 32)
    with pytest.raises(RuntimeError, match="amx_pack"):
        amx.amx_linear(torch.randn(4, 96).bfloat16(), packed, 32)
    with pytest.raises(RuntimeError, match="bias"):
        amx.amx_linear(torch.randn(4, 64).bfloat16(), packed, 32, torch.zeros(31))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        amx.amx_pack(torch.randn(8, 48))


def test_a_decoder_quant_linear_takes_the_tiles_up_to_their_rows_and_onednn_beyond(amx, monkeypatch):
    """A decoder layer's QuantLinear on an AMX CPU carries a tile copy: inputs of AMX_MIN_ROWS to
    amx_linear_max_rows() rows (a decode step's) run amx_linear on it, more run oneDNN; both are bf16
    GEMMs of the same weights and agree to bf16 precision. The LM head (tiles=False) has none."""
    from kvserve.model.quant import quantize
    from kvserve.model.quant_linear import AMX_MIN_ROWS, QuantLinear

    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(1))
    linear = QuantLinear(quantize(w, "q4_1"), None, torch.float32, amx=True, tiles=True)
    assert linear.tiles is not None and linear.tile_rows == amx.amx_linear_max_rows()
    assert QuantLinear(quantize(w, "q4_1"), None, torch.float32, amx=True).tiles is None
    calls = []
    onednn = linear.amx.forward
    monkeypatch.setattr(linear.amx, "forward", lambda x, dtype=None: calls.append(x.shape[0]) or onednn(x, dtype))
    x = torch.randn(linear.tile_rows + 8, 128)
    many = linear(x)
    few = linear(x[: AMX_MIN_ROWS + 4])
    assert calls == [x.shape[0]]  # only the many-row input reached oneDNN
    torch.testing.assert_close(few, many[: AMX_MIN_ROWS + 4], rtol=2**-7, atol=1e-2)


def test_without_amx_amx_linear_says_so(ops):
    if ops.amx_gemm_available():
        pytest.skip("this CPU has AMX")
    with pytest.raises(RuntimeError, match="no AMX-BF16"):
        ops.amx_linear(torch.randn(4, 64).bfloat16(), ops.amx_pack(torch.randn(32, 64)), 32)
