"""The model's last layer for the sampled rows only (``keep_rows``): the same hidden states for those
rows and the same KV cache as the whole step, on each attention backend and with the quantized
linears; and the runner's tokens unchanged by it."""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import tiny_weights
from kvserve.attention import SeqRows
from kvserve.config import CacheConfig
from kvserve.runner.inputs import build_inputs
from kvserve.runner.torch_runner import TorchRunner

needs_kernels = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


def _runner(backend: str, quantization: str = "none") -> TorchRunner:
    cfg, weights = tiny_weights()
    cache = CacheConfig(num_kv_blocks=64, block_size=4, attention_backend=backend)
    return TorchRunner(cfg, weights, cache, dtype=torch.float32, quantization=quantization)


def _step(runner: TorchRunner, keep: list[int] | None) -> torch.Tensor:
    """One step over fresh caches: a 30-token prompt, a 9-token prompt and a one-token prompt."""
    for layer in runner.kv_pool.layers:
        for t in layer:
            t.zero_()
    seqs = [SeqRows(list(range(3, 33)), 0, list(range(0, 8))), SeqRows(list(range(40, 49)), 0, list(range(8, 11))),
            SeqRows([7], 0, [11])]
    inputs = build_inputs(seqs, runner.attention)
    rows = None if keep is None else torch.tensor(keep, dtype=torch.long)
    return runner.model(inputs.input_ids, inputs.positions, runner.attention, inputs.meta, runner.kv_pool.layers,
                        keep_rows=rows)


@needs_kernels
@pytest.mark.parametrize("backend,quantization", [("paged", "none"), ("gather-sdpa", "none"), ("paged", "int8")])
def test_kept_rows_match_the_whole_step(backend, quantization):
    runner = _runner(backend, quantization)
    full = _step(runner, None)
    full_kv = [t.clone() for layer in runner.kv_pool.layers for t in layer]
    for keep in ([29, 38, 39], [27, 28, 29], []):  # each prompt's last row; a verify-like run; nothing sampled
        got = _step(runner, keep)
        assert got.shape == (len(keep), full.shape[1])
        if quantization == "none":
            torch.testing.assert_close(got, full[keep], atol=1e-5, rtol=1e-5)
        elif keep:  # on AMX the whole step's 40 rows take the bf16 GEMM and 3 kept rows the integer
            # kernels (fewer than AMX_MIN_ROWS): two roundings of the same weights, not one result
            assert (got - full[keep]).norm() / full[keep].norm() < 0.05
        kv = [t for layer in runner.kv_pool.layers for t in layer]
        assert all(torch.equal(a, b) for a, b in zip(kv, full_kv))  # the last layer still wrote every row's K/V
