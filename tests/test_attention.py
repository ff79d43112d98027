"""Paged attention: the native decode kernel against the pure-torch path, on a scattered cache."""

import pytest
import torch

from kvserve.model import attention
from kvserve.model.attention import AttentionMetadata
from kvserve.model.kernels import native


def scattered_case(dtype, heads=6, kv_heads=2, d=32, block=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.tensor([1, 5, 17, 9])
    num_blocks = 40
    k_cache = torch.randn((num_blocks + 1) * block, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn((num_blocks + 1) * block, kv_heads, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # each sequence's blocks scattered
    width = int(ctx.max())
    p = torch.arange(width)
    rows = []
    for i, n in enumerate(ctx.tolist()):
        table = [perm.pop() for _ in range(-(-n // block))]
        rows.append([table[t // block] * block + t % block if t < n else num_blocks * block for t in range(width)])
    slots = torch.tensor(rows)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=len(ctx), decode_slots=slots,
                             decode_mask=(p.unsqueeze(0) < ctx.unsqueeze(1))[:, None, None, :], decode_context_lens=ctx)
    q = torch.randn(len(ctx), heads, d, generator=g).to(dtype)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_native_decode_matches_torch_path(dtype, tol, monkeypatch):
    lib = native()
    if lib is None:
        pytest.skip("no C++ compiler: the torch path is the only one")
    q, kc, vc, meta = scattered_case(dtype)
    got = attention._decode(q, kc, vc, meta, gqa=True)
    monkeypatch.setattr(attention, "native", lambda: None)
    want = attention._decode(q, kc, vc, meta, gqa=True)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_torch_decode_path_matches_dense_attention(monkeypatch):
    monkeypatch.setattr(attention, "native", lambda: None)
    q, kc, vc, meta = scattered_case(torch.float64)
    got = attention._decode(q, kc, vc, meta, gqa=True)
    for b, n in enumerate(meta.decode_context_lens.tolist()):
        s = meta.decode_slots[b, :n]
        k = kc[s].repeat_interleave(3, dim=1).transpose(0, 1)  # [heads, n, d]
        v = vc[s].repeat_interleave(3, dim=1).transpose(0, 1)
        w = torch.softmax(q[b].unsqueeze(1) @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        torch.testing.assert_close(got[b], (w @ v).squeeze(1))
