"""The paged attention kernel is batch-invariant: a row's output depends on its query and its context only,
bit for bit, whether it is attended as a decode, inside a prompt chunk of any length, split across
threads (flash-decoding), or beside other sequences (issue 47; docs/determinism.md)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

HEADS, KV_HEADS, D, BS = 9, 3, 64, 16


@pytest.fixture(scope="module", autouse=True)
def kernels():
    from kvserve.kernels import load_kernels

    if not load_kernels():
        pytest.skip("native kernels did not build")


def make_cache(ctx: int, dtype: torch.dtype, seed: int = 0):
    """One sequence's K/V over shuffled blocks, and a query row per position."""
    g = torch.Generator().manual_seed(seed)
    blocks = math.ceil(ctx / BS) + 3
    k = torch.randn(blocks * BS, KV_HEADS, D, generator=g)
    v = torch.randn(blocks * BS, KV_HEADS, D, generator=g)
    scales = None
    if dtype == torch.int8:  # per-channel scales, as the int8 pool keeps them
        ks, vs = k.abs().amax(0) / 127, v.abs().amax(0) / 127
        k, v = (k / ks).round().to(torch.int8), (v / vs).round().to(torch.int8)
        scales = (ks.contiguous(), vs.contiguous())
    else:
        k, v = k.to(dtype), v.to(dtype)
    table = torch.randperm(blocks, generator=g).to(torch.int32)
    q = torch.randn(ctx, HEADS, D, generator=g)
    return q, k, v, table, scales


def attend(q_rows, k, v, table, seqs, scales, **kw) -> torch.Tensor:
    """``seqs``: (first row, rows, context) per sequence, all over ``table``."""
    out = torch.full_like(q_rows, float("nan"))
    tables = torch.cat([table] * len(seqs))
    info = torch.tensor([(r, n, c, i * table.numel()) for i, (r, n, c) in enumerate(seqs)], dtype=torch.int32)
    ks, vs = scales if scales is not None else (None, None)
    torch.ops.kvserve.paged_attention(out, q_rows, k, v, tables, info, BS, D ** -0.5, ks, vs, invariant=True, **kw)
    return out


def prefill(q, k, v, table, scales, chunk: int, **kw) -> torch.Tensor:
    """Every position's row, in chunks of ``chunk`` rows, all in one call."""
    ctx = q.shape[0]
    seqs = [(s, min(chunk, ctx - s), min(s + chunk, ctx)) for s in range(0, ctx, chunk)]
    return attend(q, k, v, table, seqs, scales, **kw)


CASES = [pytest.param(torch.float32, {}, id="float32"), pytest.param(torch.int8, {}, id="int8"),
         pytest.param(torch.bfloat16, {}, id="bfloat16"),
         pytest.param(torch.float32, {"window": 100, "softcap": 30.0}, id="window-softcap"),
         pytest.param(torch.int8, {"window": 37}, id="int8-window")]


@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("dtype, opts", CASES)
def test_prompt_rows_equal_in_any_chunking_and_as_decodes(threads, dtype, opts):
    q, k, v, table, scales = make_cache(1300, dtype)
    whole = prefill(q, k, v, table, scales, 1300, **opts)
    for chunk in (64, 16, 5, 1):
        assert torch.equal(prefill(q, k, v, table, scales, chunk, **opts), whole), chunk
    # decodes: alone (a long one is split across the threads), and among other decodes (not split)
    for p in (0, 15, 16, 511, 512, 513, 1023, 1024, 1299):  # partitions of 512 keys; split from 1,024
        alone = attend(q[p : p + 1], k, v, table, [(0, 1, p + 1)], scales, **opts)
        assert torch.equal(alone[0], whole[p]), p
    positions = list(range(0, 1300, 13))
    batch = attend(q[positions], k, v, table, [(i, 1, p + 1) for i, p in enumerate(positions)], scales, **opts)
    assert torch.equal(batch, whole[positions])


@pytest.mark.parametrize("threads", [1, 2, 4], indirect=True)
def test_split_decodes_fold_their_partitions_as_a_whole_decode_does(threads):
    # long contexts whose decodes the plan splits into parts (differently on each thread count): the same bits
    q, k, v, table, scales = make_cache(3000, torch.float32, seed=1)
    for p in (200, 1000, 2999):
        alone = attend(q[p : p + 1], k, v, table, [(0, 1, p + 1)], scales)
        rows = torch.cat([q[p : p + 1], q[1:64]])  # among 63 short decodes
        with_many = attend(rows, k, v, table, [(i, 1, p + 1 if i == 0 else 20 + i) for i in range(64)], scales)
        assert torch.equal(alone[0], with_many[0]), p
    if threads == 2:  # the reference: the same row on one thread, never split
        torch.set_num_threads(1)
        try:
            one = attend(q[2999:], k, v, table, [(0, 1, 3000)], scales)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, attend(q[2999:], k, v, table, [(0, 1, 3000)], scales))
