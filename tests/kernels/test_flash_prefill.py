"""flash_prefill (AMX brgemm prompt attention over a bf16 paged cache) against the float64 reference
of the paged attention tests: whole prompts, chunks continuing a cached context, several sequences
at once, GQA groups of 1-8, head dims 64 and 128, partial blocks, bf16 and float32 queries, strided
q, only the listed rows written, and bad tables refused. Runs where the op does (AMX); skipped
elsewhere."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from test_paged_attention import check_bad_tables_refused, make_case, reference

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


@pytest.fixture(scope="module", autouse=True)
def flash():
    from kvserve.kernels import load_kernels

    if not load_kernels():
        pytest.skip("native kernels did not build")
    if not torch.ops.kvserve.flash_prefill_available():
        pytest.skip("flash_prefill needs a bf16 brgemm (AMX) and an AVX512-BF16 build")


def run_flash(q, k, v, tables, info, bs, out_dtype=None) -> torch.Tensor:
    out = torch.full(q.shape, float("nan"), dtype=out_dtype or q.dtype)
    torch.ops.kvserve.flash_prefill(out, q, k, v, tables, info, bs, 1 / math.sqrt(q.shape[-1]))
    return out


def check(seqs, q_dtype=torch.bfloat16, out_dtype=None, **kw):
    q, k, v, tables, info, bs = make_case(seqs, dtype=torch.bfloat16, **kw)
    q = q.to(q_dtype)
    got = run_flash(q, k, v, tables, info, bs, out_dtype)
    # q (when float32) and the probabilities are rounded to bf16 for the GEMMs, sums stay float32
    want = reference(q.bfloat16(), k, v, tables, info, bs)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    return got


@pytest.mark.parametrize("seqs", [
    [(1860, 1860)],  # a whole prompt: 29 tasks per kv head, blocks of 256 keys
    [(564, 1860), (68, 1860), (5, 40), (70, 70)],  # chunks continuing contexts, a short prompt
    [(2, 2), (3, 200), (129, 129)],  # the fewest rows, an odd number of keys, one row past a task
])
def test_prompts_and_continuing_chunks(seqs):
    check(seqs, heads=9, kv_heads=3)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (12, 2), (16, 2)])  # groups of 1, 4, 6, 8
def test_gqa_groups(heads, kv_heads):
    check([(100, 333), (33, 33)], heads=heads, kv_heads=kv_heads)


@pytest.mark.parametrize("d,bs", [(64, 7), (128, 16), (128, 32)])
def test_head_dims_and_block_sizes(d, bs):
    check([(90, 300), (17, 17)], heads=8, kv_heads=2, d=d, bs=bs)


@pytest.mark.parametrize("q_dtype,out_dtype", [(torch.float32, None), (torch.bfloat16, torch.float32),
                                               (torch.float32, torch.bfloat16)])
def test_float32_and_bfloat16_rows(q_dtype, out_dtype):
    check([(80, 200)], q_dtype=q_dtype, out_dtype=out_dtype, heads=9, kv_heads=3)


def test_only_the_listed_rows_are_written_and_strided_q_works():
    q, k, v, tables, info, bs = make_case([(40, 100), (30, 30)], heads=9, kv_heads=3, dtype=torch.bfloat16)
    want = run_flash(q, k, v, tables, info, bs)
    # q as a view of a fused qkv output: each token's row strided past its k and v
    qkv = torch.cat([q.flatten(1), torch.randn(q.shape[0], 2 * 3 * 64).bfloat16()], dim=1)
    strided = qkv[:, : 9 * 64].view(q.shape)
    assert not strided.is_contiguous()
    torch.testing.assert_close(run_flash(strided, k, v, tables, info, bs), want, atol=0, rtol=0)
    # rows of no listed sequence stay as they were
    extra = torch.cat([q, torch.randn(5, 9, 64).bfloat16()])
    out = run_flash(extra, k, v, tables, info, bs)
    assert out[70:].isnan().all() and not out[:70].isnan().any()


def test_sequences_sharing_a_prefix_share_its_packed_keys():
    """RAG's shape: sequences whose tables begin with the same blocks (a shared document) pack those
    keys once. Shared chunks must still be told apart where a sequence's keys stop inside one (1,125
    and 1,130 keys end in the same block: fewer valid keys) or its table parts from the others."""
    bs = 16
    q, k, v, _, _, _ = make_case([(1, 1400)], heads=9, kv_heads=3, bs=bs, dtype=torch.bfloat16)  # 93 blocks of K/V
    doc = list(range(0, 71))  # 71 blocks = 1,136 keys shared, then each sequence's own blocks
    own = iter(range(71, 93))
    seqs = [(300, 1200), (30, 1125), (81, 1130), (200, 1200), (40, 560), (1120, 1120)]
    tables, info, row = [], [], 0
    for n, ctx in seqs:
        nb = -(-ctx // bs)
        table = doc[:nb] + [next(own) for _ in range(max(0, nb - len(doc)))]
        info.append([row, n, ctx, len(tables)])
        tables += table
        row += n
    g = torch.Generator().manual_seed(1)
    q = torch.randn(row, 9, 64, generator=g).bfloat16()
    tables, info = torch.tensor(tables, dtype=torch.int32), torch.tensor(info, dtype=torch.int32)
    got = run_flash(q, k, v, tables, info, bs)
    torch.testing.assert_close(got.double(), reference(q, k, v, tables, info, bs), atol=2e-2, rtol=2e-2)
    # each sequence alone gives the same rows (the chunks it shares are the chunks it would pack)
    for s, (first, n, ctx, off) in enumerate(info.tolist()):
        one = torch.tensor([[0, n, ctx, 0]], dtype=torch.int32)
        alone = run_flash(q[first:first + n].contiguous(), k, v, tables[off:].contiguous(), one, bs)
        assert torch.equal(alone, got[first:first + n]), s


def test_repeatable():
    q, k, v, tables, info, bs = make_case([(300, 700), (64, 64)], heads=9, kv_heads=3, dtype=torch.bfloat16)
    first = run_flash(q, k, v, tables, info, bs)
    torch.testing.assert_close(run_flash(q, k, v, tables, info, bs), first, atol=0, rtol=0)


def test_bad_tables_and_shapes_are_refused():
    case = make_case([(20, 30)], heads=9, kv_heads=3, dtype=torch.bfloat16)
    check_bad_tables_refused(run_flash, case, "outside the cache", "runs past block_tables")
    q, k, v, tables, info, bs = case
    rows = info.clone()
    rows[0, 1] = 21  # more rows than q has
    with pytest.raises(RuntimeError, match="bad seq_info"):
        run_flash(q, k, v, tables, rows, bs)
    with pytest.raises(RuntimeError, match="bfloat16"):
        run_flash(q, k.float(), v.float(), tables, info, bs)


def test_a_score_far_above_the_first_blocks_moves_the_reference():
    """softmax_block exponentiates later blocks against the first block's max while they stay within
    2^64 of it; a key past the first 256 whose scores are far above that takes the rescaling path
    (every row after it puts almost all its weight there)."""
    q, k, v, tables, info, bs = make_case([(40, 600)], heads=4, kv_heads=2, dtype=torch.bfloat16)
    slot = tables[400 // bs].item() * bs + 400 % bs  # key 400 of the only sequence
    u = torch.randn(64, generator=torch.Generator().manual_seed(1))
    q[:, :2] = u.bfloat16()  # kv head 0's query heads, all rows: scores 20 |u|^2 / 8 ~ 160 at key 400
    k[slot, 0] = (20 * u).bfloat16()
    got = run_flash(q, k, v, tables, info, bs)
    want = reference(q, k, v, tables, info, bs)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    assert torch.allclose(want[:, 0].float(), v[slot, 0].float(), atol=0.05)  # the case does what it says
