"""``--attention-backend auto`` (the default): ``paged`` where its kernel runs (CPU, native kernels
built, K/V stored in float32 or bfloat16 as the model computes, or in 8 bits), else ``gather-sdpa``; one log
line says which and why."""

from __future__ import annotations

import logging

import torch

from kvserve.attention.backend import AttentionBackend, get_attention_backend
from kvserve.attention.paged import paged_unsupported

log = logging.getLogger(__name__)

AUTO = "auto"
_logged: set[str] = set()  # the target and a draft model choose alike: say it once


def choose_attention_backend(name: str, device: torch.device | str, model_dtype: torch.dtype,
                             kv_dtype: torch.dtype) -> type[AttentionBackend]:
    """The backend class for ``--attention-backend name``, resolving ``auto`` for this setup."""
    if name != AUTO:
        return get_attention_backend(name)
    reason = paged_unsupported(torch.device(device), model_dtype, kv_dtype)
    if reason is None:
        chosen, why = "paged", f"native kernel on CPU, {str(kv_dtype).removeprefix('torch.')} KV"
    else:
        chosen, why = "gather-sdpa", reason
    line = f"attention backend: {chosen} (auto: {why})"
    if line not in _logged:
        _logged.add(line)
        log.info(line)
    return get_attention_backend(chosen)
