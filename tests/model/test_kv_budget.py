"""The default KV cache size: max_num_seqs sequences of max_model_len tokens, capped by free memory."""

from __future__ import annotations

import torch

from conftest import tiny_weights
from kvserve.config import CacheConfig
from kvserve.runner import kv_budget
from kvserve.runner.torch_runner import TorchRunner

GiB = 1 << 30


def test_budget_is_what_the_scheduler_could_hold_when_memory_allows(monkeypatch):
    monkeypatch.setattr(kv_budget, "available_host_bytes", lambda: 64 * GiB)
    b = kv_budget.default_kv_budget(1000, max_model_len=2048, max_num_seqs=8, device=torch.device("cpu"))
    assert b.nbytes == b.wanted_bytes == 1000 * 2048 * 8 and not b.capped
    assert "8 sequences x 2048 tokens" in kv_budget.describe(b, 2048, 8)


def test_budget_is_capped_by_a_quarter_of_free_memory_and_4_gib(monkeypatch):
    monkeypatch.setattr(kv_budget, "available_host_bytes", lambda: 8 * GiB)
    b = kv_budget.default_kv_budget(46080, max_model_len=8192, max_num_seqs=128, device=torch.device("cpu"))
    assert b.capped and b.nbytes == 2 * GiB
    assert "a quarter of available memory" in kv_budget.describe(b, 8192, 128)
    monkeypatch.setattr(kv_budget, "available_host_bytes", lambda: 100 * GiB)
    b = kv_budget.default_kv_budget(46080, max_model_len=8192, max_num_seqs=128, device=torch.device("cpu"))
    assert b.nbytes == 4 * GiB and "4 GiB ceiling" in kv_budget.describe(b, 8192, 128)


def test_runner_sizes_its_pool_from_the_flags(monkeypatch):
    monkeypatch.setattr(kv_budget, "available_host_bytes", lambda: 64 * GiB)
    cfg, weights = tiny_weights()
    runner = TorchRunner(cfg, weights, CacheConfig(block_size=16), dtype=torch.float32, max_model_len=64,
                         max_num_seqs=3)
    assert runner.num_kv_blocks == 3 * 64 // 16
    override = TorchRunner(cfg, weights, CacheConfig(block_size=16, kv_cache_memory_gb=0.001), dtype=torch.float32,
                           max_model_len=64, max_num_seqs=3)
    assert override.num_kv_blocks == int(0.001 * GiB) // override.block_bytes
