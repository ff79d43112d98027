"""Sliding windows, soft caps and sinks in the native attention kernels (paged_attention, flash_prefill)
against a float64 torch reference: windows shorter and longer than the context and crossing block
boundaries, soft caps, both at once, decodes and multi-row chunks (each row its own window start),
decodes split across threads, and block tables whose entries before the window are a placeholder
(-1) that the kernels must not read. The kernel paths this CPU has are each reached by a cache dtype
and head size: float32 (vector dot products), bfloat16 (pair dot products; AMX tiles for decodes at
head size 64, blocks of 16), int8 and fp8 (rows widened to float32), head sizes off the unrolled ones.
Sinks (a logit per query head in the softmax's denominator) in the paged kernel, with windows and caps."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from test_paged_attention import make_case

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
PLACEHOLDER = -1


@pytest.fixture(scope="module", autouse=True)
def kernels():
    from kvserve.kernels import load_kernels

    if not load_kernels():
        pytest.skip("native kernels did not build")


def key_start(pos: int, window: int) -> int:
    return max(0, pos - window + 1) if window > 0 else 0


def reference(q, k, v, tables, info, bs, window=0, softcap=0.0, scale=None, sinks=None) -> torch.Tensor:
    """Each row over its keys (its window's, causal), scores scaled then capped, in float64, each head's
    sink (if any) a column in its softmax that weighs no value; reads no table entry before the
    sequence's first window."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    rep = q.shape[1] // k.shape[1]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    for row, n, ctx, offset in info.tolist():
        table = tables[offset:].tolist()
        lo = key_start(ctx - n, window)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(lo, ctx)])
        kc = k[slots].double().repeat_interleave(rep, dim=1).transpose(0, 1)  # [heads, ctx - lo, d]
        vc = v[slots].double().repeat_interleave(rep, dim=1).transpose(0, 1)
        qs = q[row : row + n].double().transpose(0, 1)
        scores = qs @ kc.transpose(1, 2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(ctx - n, ctx)[:, None]
        keys = torch.arange(lo, ctx)[None, :]
        seen = (keys <= pos) & ((keys > pos - window) if window > 0 else True)
        scores = scores.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            sink = sinks.double()[:, None, None].expand(-1, n, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[row : row + n] = (probs @ vc).transpose(0, 1)
    return out


def with_placeholders(tables, info, bs, window) -> torch.Tensor:
    """The tables with every block wholly before its sequence's first window replaced by -1."""
    t = tables.clone()
    for _, n, ctx, offset in info.tolist():
        for b in range(key_start(ctx - n, window) // bs):
            t[offset + b] = PLACEHOLDER
    return t


def to_cache(k, v, kv: str):
    """k, v (float32) stored as ``kv``, with the 8-bit formats' [kv_heads, d] scales; and the values
    the kernel reads (dequantized), for the reference."""
    if kv in ("float32", "bfloat16"):
        dt = getattr(torch, kv)
        return k.to(dt), v.to(dt), (), k.to(dt).float(), v.to(dt).float()
    ks, vs = k.abs().amax(0) / 100 + 1e-3, v.abs().amax(0) / 100 + 1e-3
    if kv == "int8":
        kq, vq = (k / ks).round().clamp(-127, 127).to(torch.int8), (v / vs).round().clamp(-127, 127).to(torch.int8)
    else:
        kq, vq = (k / ks).to(torch.float8_e4m3fn), (v / vs).to(torch.float8_e4m3fn)
    return kq, vq, (ks, vs), kq.float() * ks, vq.float() * vs


def run_paged(q, k, v, tables, info, bs, window=0, softcap=0.0, scales=(), sinks=None):
    out = torch.full_like(q, float("nan"))
    torch.ops.kvserve.paged_attention(out, q, k, v, tables, info, bs, 1 / math.sqrt(q.shape[-1]), *scales,
                                      window=window, softcap=softcap, sinks=sinks)
    return out


def check(seqs, window, softcap, kv="float32", sinks=False, **kw):
    q, k, v, tables, info, bs = make_case(seqs, **kw)
    kc, vc, scales, kr, vr = to_cache(k, v, kv)
    tables = with_placeholders(tables, info, bs, window)
    # sinks from well below the scores to above them: a sink can take most of a row's mass
    sink = torch.linspace(-4.0, 6.0, q.shape[1]) if sinks else None
    got = run_paged(q, kc, vc, tables, info, bs, window, softcap, scales if scales else (None, None), sink)
    want = reference(q, kr, vr, tables, info, bs, window, softcap, sinks=sink)
    bf16_dots = kv == "bfloat16" and torch.ops.kvserve.bf16_dot_attention()
    tol = dict(atol=1e-2, rtol=1e-2) if bf16_dots else dict(atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(got.double(), want, **tol)
    return got


DECODES = [(1, c) for c in (1, 2, 15, 16, 17, 33, 64, 130, 700)]
# (window, softcap): windows of one key, shorter than a block, crossing blocks, past every context;
# a cap alone; both
OPTIONS = [(1, 0.0), (5, 0.0), (37, 0.0), (100, 0.0), (5000, 0.0), (0, 2.0), (23, 1.5)]


@pytest.mark.parametrize("window, softcap", OPTIONS)
@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8", "float8_e4m3fn"])
def test_decodes(window, softcap, kv):
    check(DECODES, window, softcap, kv, heads=8, kv_heads=2)


@pytest.mark.parametrize("window, softcap", OPTIONS)
@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8"])
def test_multi_row_chunks_each_row_its_own_window(window, softcap, kv):
    # chunks longer than a tile, chunks that start their sequence, a tile boundary inside a block
    check([(5, 12), (37, 100), (16, 16), (50, 50), (2, 300), (1, 90), (20, 400)], window, softcap, kv, heads=6, kv_heads=2)


@pytest.mark.parametrize("d, bs, heads, kv_heads", [(64, 16, 9, 3), (64, 32, 16, 4), (64, 64, 8, 1), (64, 7, 8, 2),
                                                    (128, 16, 8, 2), (80, 7, 6, 2), (20, 5, 4, 4)])
@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_head_sizes_block_sizes_and_groups(d, bs, heads, kv_heads, kv):
    # head size 64 over bf16 blocks of 16, 32 and 64: AMX tiles, 32 keys a step (windows starting past a
    # whole step of a block); 128 and blocks of 7: pair dot products, 16 keys at a time; 80 and 20: no
    # unrolled size
    seqs = [(1, 3), (1, 47), (1, 200), (1, 333), (3, 70), (18, 150)]
    for window, softcap in [(45, 0.0), (70, 3.0), (0, 3.0)]:
        check(seqs, window, softcap, kv, d=d, bs=bs, heads=heads, kv_heads=kv_heads)


@pytest.mark.parametrize("threads", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
@pytest.mark.parametrize("window", [40, 300, 1111])
def test_long_decodes_split_across_threads_over_their_window(threads, kv, window):
    check([(1, 2500), (1, 7), (1, 1200)], window, 0.0, kv, heads=9, kv_heads=3)
    check([(1, 3000)], window, 4.0, kv, heads=8, kv_heads=2)


@pytest.mark.parametrize("window, softcap", [(0, 0.0), (5, 0.0), (37, 2.0)])
@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8"])
def test_sinks(window, softcap, kv):
    # decodes and multi-row chunks; decodes over bf16 blocks of 16 at head size 64 run on AMX tiles where present
    check(DECODES + [(5, 12), (37, 100), (16, 16)], window, softcap, kv, sinks=True, heads=8, kv_heads=2)
    check([(1, 47), (1, 200), (18, 150)], window, softcap, kv, sinks=True, d=64, bs=16, heads=8, kv_heads=2)


@pytest.mark.parametrize("threads", [2, 4], indirect=True)
def test_sinks_in_decodes_split_across_threads(threads):
    """A split decode's parts are merged before the sink joins: the sink counted once."""
    check([(1, 2500), (1, 7), (1, 1200)], 0, 0.0, "float32", sinks=True, heads=9, kv_heads=3)
    check([(1, 3000)], 300, 4.0, "bfloat16", sinks=True, heads=8, kv_heads=2)


def test_window_and_cap_off_are_the_plain_kernel():
    q, k, v, tables, info, bs = make_case([(1, 100), (9, 60)])
    plain = torch.full_like(q, float("nan"))
    torch.ops.kvserve.paged_attention(plain, q, k, v, tables, info, bs, 1 / 8)
    torch.testing.assert_close(run_paged(q, k, v, tables, info, bs, 0, 0.0), plain, atol=0, rtol=0)
    # a window past every context changes nothing either
    torch.testing.assert_close(run_paged(q, k, v, tables, info, bs, 10_000, 0.0), plain, atol=0, rtol=0)


def test_a_placeholder_inside_the_window_is_refused():
    # the first row's window starts in block 2 of the 100-key decode: block 1 holds a placeholder
    q, k, v, tables, info, bs = make_case([(1, 100)])
    bad = tables.clone()
    bad[2] = PLACEHOLDER
    with pytest.raises(RuntimeError, match="block id out of range"):
        run_paged(q, k, v, bad, info, bs, window=100 - 2 * 16)


# -- flash_prefill ------------------------------------------------------------------------------------

def flash_available() -> bool:
    return bool(torch.ops.kvserve.flash_prefill_available())


def run_flash(q, k, v, tables, info, bs, window=0, softcap=0.0):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    torch.ops.kvserve.flash_prefill(out, q, k, v, tables, info, bs, 1 / math.sqrt(q.shape[-1]), window=window,
                                    softcap=softcap)
    return out


@pytest.mark.parametrize("window, softcap", [(1, 0.0), (37, 0.0), (256, 0.0), (300, 0.0), (700, 0.0), (5000, 0.0),
                                             (0, 2.0), (100, 3.0)])
def test_flash_prefill(window, softcap):
    # whole prompts and chunks continuing a context, over several 256-key blocks: windows inside one,
    # across their boundaries, longer than the context; tasks whose rows start their windows in
    # different blocks; sequences sharing a prefix's blocks (packed once)
    if not flash_available():
        pytest.skip("flash_prefill needs a bf16 brgemm (AMX) and an AVX512-BF16 build")
    seqs = [(600, 600), (70, 1000), (5, 40), (129, 129), (300, 1860)]
    q, k, v, tables, info, bs = make_case(seqs, heads=9, kv_heads=3, dtype=torch.bfloat16)
    tables = with_placeholders(tables, info, bs, window)
    got = run_flash(q, k, v, tables, info, bs, window, softcap)
    want = reference(q, k, v, tables, info, bs, window, softcap)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


def test_flash_prefill_shared_prefix_with_a_window():
    """Two chunks over the same cached document (shared blocks) whose windows start at different keys
    of one 256-key block: each packs what it sees, zeros before its start, so their shared chunks
    must be told apart."""
    if not flash_available():
        pytest.skip("flash_prefill needs a bf16 brgemm (AMX) and an AVX512-BF16 build")
    bs, window = 16, 200
    q, k, v, _, _, _ = make_case([(1, 1400)], heads=4, kv_heads=2, bs=bs, dtype=torch.bfloat16)
    doc = list(range(71))
    tables, info, row = [], [], 0
    for n, ctx in [(40, 1000), (30, 1040), (100, 1100)]:
        info.append([row, n, ctx, len(tables)])
        tables += doc[: -(-ctx // bs)]
        row += n
    q = torch.randn(row, 4, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    tables, info = torch.tensor(tables, dtype=torch.int32), torch.tensor(info, dtype=torch.int32)
    got = run_flash(q, k, v, tables, info, bs, window)
    torch.testing.assert_close(got.double(), reference(q, k, v, tables, info, bs, window), atol=2e-2, rtol=2e-2)
