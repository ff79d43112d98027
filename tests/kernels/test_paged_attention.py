"""The paged attention op against a plain torch reference (gather through the block table, then a
masked softmax in float64): ragged decodes, scattered tables, partial blocks, GQA and MHA,
multi-token rows continuing a context, mixed batches, float32 and bfloat16, and decodes whose
context the kernel splits into parts across threads (flash-decoding) and merges."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    from kvserve.kernels import load_kernels

    if not load_kernels():
        pytest.skip("native kernels did not build")


def make_case(seqs: list[tuple[int, int]], *, heads=6, kv_heads=2, d=64, bs=16, dtype=torch.float32, seed=0,
              pad_width=3):
    """``seqs``: (query rows, context length incl. them) per sequence; the blocks of all sequences
    are one shuffled pool, so every table is non-contiguous."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(ctx / bs) for _, ctx in seqs]
    num_blocks = sum(need) + 5
    k = torch.randn(num_blocks * bs, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(num_blocks * bs, kv_heads, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables: list[int] = []
    info = []
    row = 0
    for (n, ctx), nb in zip(seqs, need):
        info.append([row, n, ctx, len(tables)])
        tables += [perm.pop() for _ in range(nb)] + [0] * pad_width  # tables may hold more than the context needs
        row += n
    q = torch.randn(row, heads, d, generator=g).to(dtype)
    return q, k, v, torch.tensor(tables, dtype=torch.int32), torch.tensor(info, dtype=torch.int32), bs


def reference(q, k, v, tables, info, bs) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64)
    rep = q.shape[1] // k.shape[1]
    for row, n, ctx, offset in info.tolist():
        table = tables[offset:].tolist()
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx)])
        kc = k[slots].double().repeat_interleave(rep, dim=1).transpose(0, 1)  # [heads, ctx, d]
        vc = v[slots].double().repeat_interleave(rep, dim=1).transpose(0, 1)
        qs = q[row : row + n].double().transpose(0, 1)  # [heads, n, d]
        scores = qs @ kc.transpose(1, 2) / math.sqrt(q.shape[-1])
        causal = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        out[row : row + n] = (torch.softmax(scores, dim=-1) @ vc).transpose(0, 1)
    return out


def run_op(q, k, v, tables, info, bs) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    torch.ops.kvserve.paged_attention(out, q, k, v, tables, info, bs, 1 / math.sqrt(q.shape[-1]))
    return out


def check(seqs, tol=2e-5, **kw):
    q, k, v, tables, info, bs = make_case(seqs, **kw)
    got = run_op(q, k, v, tables, info, bs)
    want = reference(q, k, v, tables, info, bs)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_decodes_with_very_different_contexts_and_partial_blocks():
    check([(1, c) for c in (1, 2, 15, 16, 17, 33, 130, 700, 1500)])


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_gqa_and_mha(heads, kv_heads):
    check([(1, 40), (1, 5), (1, 200)], heads=heads, kv_heads=kv_heads)


@pytest.mark.parametrize("d, bs", [(64, 16), (128, 4), (32, 1), (80, 7), (20, 5)])
def test_head_dims_and_block_sizes(d, bs):
    check([(1, 23), (3, 30), (1, 1)], d=d, bs=bs)


def test_multi_token_rows_continue_a_cached_context():
    # chunks longer than a tile, a tile boundary inside a block, a chunk that starts the sequence
    check([(5, 12), (37, 100), (16, 16), (50, 50), (2, 300)])


def test_mixed_batch_of_decodes_chunks_and_a_fresh_prefill():
    check([(1, 9), (1, 64), (1, 513), (20, 90), (4, 4), (33, 33), (6, 1006)], heads=9, kv_heads=3)


def test_bfloat16_q_and_kv():
    check([(1, 17), (1, 300), (9, 60), (18, 18)], dtype=torch.bfloat16, tol=2e-2)


@pytest.mark.parametrize("d", [64, 128])
def test_float32_q_with_bfloat16_kv(d):
    # odd block fills, a multi-token tile, and a long decode that two threads split along its keys
    q, k, v, tables, info, bs = make_case([(1, 50), (7, 70), (1, 1001), (3, 33)], d=d)
    kb, vb = k.bfloat16(), v.bfloat16()
    got = run_op(q, kb, vb, tables, info, bs)
    want = reference(q, kb.float(), vb.float(), tables, info, bs)
    if torch.ops.kvserve.bf16_dot_attention():
        # AVX512-BF16: q . k and p . v as bf16 pair dot products (q and the probabilities rounded to
        # bf16, float32 sums), as bf16 attention is on the AMX prefill path: bf16's precision
        torch.testing.assert_close(got.double(), want, atol=5e-3, rtol=1e-2)
    else:
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_only_the_listed_rows_are_written_and_strided_q_works():
    q, k, v, tables, info, bs = make_case([(1, 30), (4, 40)])
    wide = torch.randn(q.shape[0], q.shape[1], q.shape[2] * 2)
    wide[..., : q.shape[2]] = q
    qs = wide[..., : q.shape[2]]  # a view with a row stride twice the contiguous one
    out = torch.full((q.shape[0] + 3, *q.shape[1:]), 7.0)
    info_shifted = info.clone()
    info_shifted[:, 0] += 3
    qpad = torch.cat([torch.zeros(3, *q.shape[1:]), q])
    torch.ops.kvserve.paged_attention(out, qpad, k, v, tables, info_shifted, bs, 1 / 8)
    assert (out[:3] == 7.0).all()
    got = run_op(qs, k, v, tables, info, bs)
    torch.testing.assert_close(out[3:], got)
    torch.testing.assert_close(got.double(), reference(q, k, v, tables, info, bs), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("threads", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("ctx", [200, 1000, 4096, 1023])
def test_one_long_decode_split_across_threads(threads, ctx):
    check([(1, ctx)], heads=9, kv_heads=3)


@pytest.mark.parametrize("threads", [1, 2, 4], indirect=True)
def test_one_long_decode_among_short_ones(threads):
    # the long one mid-batch (its merged rows land at a row offset), short ones that stay whole
    check([(1, 7), (1, 33), (1, 2500), (1, 16), (1, 90)], heads=9, kv_heads=3)
    check([(1, 20), (5, 40), (1, 1500), (18, 18), (1, 300)], heads=9, kv_heads=3)  # with multi-token rows


@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("heads, kv_heads, d, bs", [(8, 1, 64, 16), (4, 4, 128, 16), (6, 2, 80, 7), (6, 3, 20, 1)])
def test_split_decode_shapes(threads, heads, kv_heads, d, bs):
    check([(1, 777)], heads=heads, kv_heads=kv_heads, d=d, bs=bs)


@pytest.mark.parametrize("heads, kv_heads, bs", [(8, 1, 16), (10, 2, 32), (6, 3, 4), (12, 2, 7), (9, 3, 16)])
def test_bfloat16_cache_decodes_every_group_and_block_size(heads, kv_heads, bs):
    # decodes over a bf16 cache (on AVX512-BF16 CPUs the pair-dot decode path: up to 4 query heads of a
    # kv head at a time, 16 keys at a time, keys past the context masked; on AMX CPUs, blocks of 16
    # and 32 keys run on tiles instead, amx_decode.h): query-head groups of 1-6,
    # blocks shorter and longer than 16 keys, odd fills; the cache's slots no context covers hold NaN,
    # which a masked key must not let through
    seqs = [(1, c) for c in (1, 2, 15, 16, 17, 31, 33, 100, 257)]
    q, k, v, tables, info, bs = make_case(seqs, heads=heads, kv_heads=kv_heads, bs=bs, d=64)
    used = torch.zeros(k.shape[0], dtype=torch.bool)
    for _, _, ctx, offset in info.tolist():
        table = tables[offset:].tolist()
        used[[table[p // bs] * bs + p % bs for p in range(ctx)]] = True
    k[~used], v[~used] = float("nan"), float("nan")
    kb, vb = k.bfloat16(), v.bfloat16()
    got = run_op(q, kb, vb, tables, info, bs)
    want = reference(q, kb.float().nan_to_num(), vb.float().nan_to_num(), tables, info, bs)
    # bf16 pair dots: q and the probabilities rounded to bf16 (see test_float32_q_with_bfloat16_kv)
    tol = dict(atol=1e-2, rtol=1e-2) if torch.ops.kvserve.bf16_dot_attention() else dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize("heads, kv_heads, bs", [(9, 3, 16), (16, 4, 16), (32, 4, 32), (12, 1, 16)])
def test_decodes_on_amx_tiles_follow_scores_that_rise_along_the_context(heads, kv_heads, bs):
    # AMX CPUs: a decode's 16 query rows at most (kv heads grouped to fit) on tiles, 32 keys a step.
    # The keys lean ever further along the queries' common direction, so each step's scores pass the
    # running max by far more than its slack: O and the sums are rescaled again and again, and the
    # weight ends on the last keys. Unused slots hold NaN, which the padded key rows must not let through.
    if not torch.ops.kvserve.amx_decode_attention():
        pytest.skip("no AMX decode attention in this build")
    seqs = [(1, c) for c in (1, 16, 17, 32, 33, 100, 300)]
    q, k, v, tables, info, bs = make_case(seqs, heads=heads, kv_heads=kv_heads, bs=bs, d=64)
    direction = torch.randn(64, generator=torch.Generator().manual_seed(1))
    q = q * 0.1 + direction
    used = torch.zeros(k.shape[0], dtype=torch.bool)
    for _, _, ctx, offset in info.tolist():
        table = tables[offset:].tolist()
        slots = [table[p // bs] * bs + p % bs for p in range(ctx)]
        used[slots] = True
        k[slots] = k[slots] * 0.1 + 0.05 * torch.arange(ctx, dtype=torch.float32)[:, None, None] * direction
    k[~used], v[~used] = float("nan"), float("nan")
    kb, vb = k.bfloat16(), v.bfloat16()
    got = run_op(q, kb, vb, tables, info, bs)
    want = reference(q, kb.float().nan_to_num(), vb.float().nan_to_num(), tables, info, bs)
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("threads", [2, 4], indirect=True)
def test_split_decode_bfloat16(threads):
    check([(1, 1234)], heads=9, kv_heads=3, dtype=torch.bfloat16, tol=2e-2)
    q, k, v, tables, info, bs = make_case([(1, 999), (1, 3)], heads=9, kv_heads=3)
    kb, vb = k.bfloat16(), v.bfloat16()  # float32 q, bfloat16 K/V
    got = run_op(q, kb, vb, tables, info, bs)
    want = reference(q, kb.float(), vb.float(), tables, info, bs)
    if torch.ops.kvserve.bf16_dot_attention():
        # AVX512-BF16: q . k and p . v as bf16 pair dot products (q and the probabilities rounded to
        # bf16, float32 sums), as bf16 attention is on the AMX prefill path: bf16's precision
        torch.testing.assert_close(got.double(), want, atol=5e-3, rtol=1e-2)
    else:
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("threads", [2, 4], indirect=True)
@pytest.mark.parametrize("ctx", [1, 15, 40, 64, 100])
def test_decode_shorter_than_a_part_is_not_split(threads, ctx):
    check([(1, ctx)], heads=9, kv_heads=3)


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_split_decode_is_repeatable(threads):
    # the kernel keeps scratch between calls: a second call, and one after a larger one, agree
    q, k, v, tables, info, bs = make_case([(1, 2000)], heads=9, kv_heads=3)
    first = run_op(q, k, v, tables, info, bs)
    check([(1, 3000), (1, 2900), (1, 100)], heads=9, kv_heads=3)
    torch.testing.assert_close(run_op(q, k, v, tables, info, bs), first, atol=0, rtol=0)


def check_bad_tables_refused(run, case, bad_block: str, short_table: str) -> None:
    """``run`` refuses (with the messages given) a table naming a block outside the cache and a
    context longer than its table, rather than follow them."""
    q, k, v, tables, info, bs = case
    bad = tables.clone()
    bad[0] = 10_000
    with pytest.raises(RuntimeError, match=bad_block):
        run(q, k, v, bad, info, bs)
    info_long = info.clone()
    info_long[0, 2] = 10_000
    with pytest.raises(RuntimeError, match=short_table):
        run(q, k, v, tables, info_long, bs)


def test_bad_indices_are_refused_not_followed():
    check_bad_tables_refused(run_op, make_case([(1, 30)]), "block id out of range", "block table too short")
