"""Paged decode attention against dense attention, on a cache whose blocks are scattered."""

import torch

from kvserve.attention.kv_pool import KVPool, LayerKV
from kvserve.attention.sdpa import DecodeGroup, GatherSdpaBackend, SdpaMetadata


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
    group = DecodeGroup(0, len(ctx), slots, (p.unsqueeze(0) < ctx.unsqueeze(1))[:, None, None, :])
    meta = SdpaMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=len(ctx), decode_groups=[group])
    q = torch.randn(len(ctx), heads, d, generator=g).to(dtype)
    return q, k_cache, v_cache, meta, ctx


def test_decode_attention_reads_through_scattered_block_tables():
    q, kc, vc, meta, ctx = scattered_case(torch.float64)
    backend = GatherSdpaBackend.__new__(GatherSdpaBackend)  # only its pool's gather is used here
    backend.pool = KVPool.__new__(KVPool)
    got = backend._decode(q, LayerKV(kc, vc), meta, gqa=True)
    for b, n in enumerate(ctx.tolist()):
        s = meta.decode_groups[0].slots[b, :n]
        k = kc[s].repeat_interleave(3, dim=1).transpose(0, 1)  # [heads, n, d]
        v = vc[s].repeat_interleave(3, dim=1).transpose(0, 1)
        w = torch.softmax(q[b].unsqueeze(1) @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        torch.testing.assert_close(got[b], (w @ v).squeeze(1))
