"""The default KV cache size: from the model, ``--max-model-len``, ``--max-num-seqs`` and free memory.

Without ``--kv-cache-memory-gb`` or ``--num-kv-blocks``, the pool holds what the scheduler could ever
use at once, ``max_num_seqs`` sequences of ``max_model_len`` tokens at the model's KV bytes per token,
capped by free memory: a quarter of the available RAM and at most 4 GiB on the CPU (the block pool
hands out blocks in FIFO order, so in time every block of the pool is touched and resident), 90% of
the free device memory on CUDA (the weights are already there). ``describe`` says what was chosen and why.
A model whose every layer has a sliding window holds per sequence no more than ``kv.manager.window_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.memory import CPU_CAP_BYTES, GiB, available_host_bytes, cpu_kv_cap_bytes

CUDA_FREE_FRACTION = 0.9


@dataclass(frozen=True)
class KVBudget:
    nbytes: int  # what the pool may take
    wanted_bytes: int  # max_num_seqs sequences of max_model_len tokens
    cap_bytes: int  # what free memory allows
    cap_reason: str  # where the cap comes from, for the log

    @property
    def capped(self) -> bool:
        return self.wanted_bytes > self.cap_bytes


def free_memory_cap(device: torch.device) -> tuple[int, str]:
    """The most the KV cache may take on ``device``, and a phrase saying why."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_FREE_FRACTION), f"{CUDA_FREE_FRACTION:.0%} of free device memory"
    avail = available_host_bytes()
    cap = cpu_kv_cap_bytes(avail)
    if cap < CPU_CAP_BYTES:
        return cap, f"a quarter of available memory ({avail / GiB:.1f} GiB)"
    return cap, "the CPU's 4 GiB ceiling"


def default_kv_budget(bytes_per_token: int, max_model_len: int, max_num_seqs: int, device: torch.device) -> KVBudget:
    """The default pool size for a model whose KV takes ``bytes_per_token``."""
    wanted = bytes_per_token * max_model_len * max_num_seqs
    cap, reason = free_memory_cap(device)
    return KVBudget(min(wanted, cap), wanted, cap, reason)


def describe(budget: KVBudget, max_model_len: int, max_num_seqs: int, windowed: bool = False) -> str:
    """Why the default pool has its size, for the start-up log (``windowed``: ``max_model_len`` is what
    one sequence holds under a sliding window, ``kv.manager.window_tokens``)."""
    per_seq = "the sliding window and a step's chunk" if windowed else "--max-model-len"
    wanted = f"{max_num_seqs} sequences x {max_model_len} tokens (--max-num-seqs x {per_seq}: " \
             f"{budget.wanted_bytes / GiB:.2f} GiB)"
    if budget.capped:
        return f"sized for {wanted}, capped at {budget.cap_bytes / GiB:.2f} GiB, {budget.cap_reason}; " \
               "--kv-cache-memory-gb sets it"
    return f"sized for {wanted}; --kv-cache-memory-gb sets it"
