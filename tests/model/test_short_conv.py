"""The short convolution (LFM2's token mixer) against torch's causal conv1d over whole sequences: its inputs kept in
the KV pool's slots (spread over several pool layers, zero-padded), read back through each sequence's block table
across steps, positions before the first masked whatever the pool's null slot holds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.attention.backend import AttentionMetadata, SeqRows
from kvserve.attention.kv_pool import KVPool
from kvserve.model.config import ModelConfig
from kvserve.model.short_conv import ShortConv

BLOCK = 4


def conv_config(taps: int, bias: bool) -> ModelConfig:
    # hidden 40 over K and V of one head of 8: three pool layers, the last half padding
    return ModelConfig(vocab_size=10, hidden_size=40, intermediate_size=8, num_hidden_layers=1, num_attention_heads=5,
                       num_key_value_heads=1, head_dim=8, conv_layers=[True], conv_kernel=taps, conv_bias=bias)


def reference(conv: ShortConv, x: torch.Tensor) -> torch.Tensor:
    """transformers' LFM2 mixer over one whole sequence x [T, hidden]."""
    b, c, u = conv.in_proj(x).split(conv.hidden_size, dim=-1)
    taps = conv.kernel.shape[1]
    y = F.conv1d((b * u).t()[None], conv.kernel[:, None], conv.bias, padding=taps - 1, groups=conv.hidden_size)
    return conv.out_proj(c * y[0, :, : x.shape[0]].t())


class Backend:  # what ShortConv reads of an attention backend
    def __init__(self, pool: KVPool):
        self.pool = pool


@pytest.mark.parametrize("taps, bias", [(3, False), (4, True)])
def test_steps_over_the_pool_equal_the_whole_sequence_convolution(taps, bias):
    torch.manual_seed(0)
    cfg = conv_config(taps, bias)
    assert cfg.cache_layers(0) == 3 and cfg.kv_cache_layers == 3
    conv = ShortConv(cfg, 0)
    with torch.no_grad():
        for p in conv.parameters():
            p.normal_(0, 0.5)
    pool = KVPool(KVPool.layout_for(cfg, torch.float32, BLOCK), num_blocks=8, device=torch.device("cpu"))
    for layer in pool.layers:  # whatever a padded write left there: never read as a position before the first
        layer[0][pool.null_slot:] = 1e3
        layer[1][pool.null_slot:] = 1e3
    backend = Backend(pool)
    xa, xb = torch.randn(7, 40), torch.randn(6, 40)
    tables = {"a": [5, 2], "b": [0, 7]}

    def step(parts: list[tuple[str, torch.Tensor, int]]) -> list[torch.Tensor]:
        """One step over (sequence, its rows, their first position)."""
        seqs = [SeqRows([0] * len(x), start, tables[name]) for name, x, start in parts]
        slots = [tables[name][p // BLOCK] * BLOCK + p % BLOCK for name, x, start in parts
                 for p in range(start, start + len(x))]
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots), seqs=seqs)
        out = conv(torch.cat([x for _, x, _ in parts]), None, backend, meta, pool.layers)
        return list(out.split([len(x) for _, x, _ in parts]))

    with torch.no_grad():
        # a's first chunk (one token short of a block), then a's rest beside b's whole prompt, then b's decode
        first = step([("a", xa[:3], 0)])
        rest, b_prompt = step([("a", xa[3:], 3), ("b", xb[:5], 0)])
        (b_decode,) = step([("b", xb[5:], 5)])
        # (the GEMMs over other row counts round otherwise: close, not equal)
        torch.testing.assert_close(torch.cat([first[0], rest]), reference(conv, xa), rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(torch.cat([b_prompt, b_decode]), reference(conv, xb), rtol=1e-4, atol=1e-3)


def test_an_eight_bit_kv_cache_is_refused_for_short_convolutions():
    from kvserve.attention.kv_pool import get_kv_pool
    from kvserve.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="short convolutions"):
        get_kv_pool("int8").layout_for(conv_config(3, False), torch.float32, BLOCK)
