"""The attention backend interface: per step, metadata from the scheduled rows; per layer, attention.

A step's rows are ragged (no padding between sequences): single-token decodes first, sorted by
context length, then multi-token rows (prefill chunks, speculative verification).
``build_metadata`` turns them into whatever the backend's kernels need (at least where each
new token's K/V goes); ``forward`` writes a layer's new K/V into the paged cache and attends.
Backends are registered by name and chosen with ``--attention-backend``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.attention.general import LayerAttention, attend_general
from kvserve.attention.kv_pool import KVPool
from kvserve.attention.registry import Registry

DEFAULT_ATTENTION_BACKEND = "auto"  # resolved by kvserve.attention.auto: paged where it runs


@dataclass
class SeqRows:
    """``tokens`` of one sequence go through the model at positions ``start``.. ; the KV of
    positions < start is in the cache, reached through ``block_table``."""

    tokens: list[int]
    start: int
    block_table: list[int]
    state_slot: int = -1  # where its recurrent layers keep their state (KVManager.state_slot); -1: none

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def is_decode(self) -> bool:
        return len(self.tokens) == 1 and self.start > 0


@dataclass
class AttentionMetadata:
    """Built once per step and shared by every layer; backends extend it."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    seqs: Sequence[SeqRows] = ()  # the step's sequences in row order


@dataclass
class NativeAttention:
    """What the native decode stack (``kvserve.model.native_stack``) needs to attend a step itself:
    the paged kernel's arguments."""

    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32, every sequence's table one after another
    seq_info: torch.Tensor  # int32 [S, 4]
    block_size: int
    scale: float
    invariant: bool = False  # the backend attends batch-invariantly (PagedBackend.invariant)


class AttentionBackend(ABC):
    # The dtype prefill chunks attend in through SDPA; None: the model's. The runner sets bfloat16
    # for a float32 model whose many-row linears already run in bf16 on AMX (``QuantLinear.amx``).
    prefill_dtype: torch.dtype | None = None

    def __init__(self, pool: KVPool, model_dtype: torch.dtype):
        self.pool = pool
        self.device = pool.device
        self.model_dtype = model_dtype

    @abstractmethod
    def build_metadata(self, seqs: Sequence[SeqRows], num_decodes: int) -> AttentionMetadata:
        """``seqs`` in row order: the first ``num_decodes`` are decodes, sorted by context length."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer_kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                scale: float | None = None) -> torch.Tensor:
        """q: [T, heads, d]; k, v: [T, kv_heads, d] for the new tokens; ``layer_kv``: the layer's
        (K, V) cache from the pool; ``scale``: the softmax's (None: head_dim ** -0.5). Writes k, v to
        their slots; returns [T, heads, d]."""

    def forward_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     layer_kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                     rows: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """As ``forward`` (every row's k, v written), but the attention of ``rows`` (int64 row indices,
        each sequence's ascending) only: [len(rows), heads, d]. The model's last layer needs no more
        than the rows the step samples. By default, all rows' then those."""
        return self.forward(q, k, v, layer_kv, meta, *(() if scale is None else (scale,)))[rows]

    def attend_layer(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     layer_kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                     spec: LayerAttention, rows: torch.Tensor | None = None) -> torch.Tensor:
        """A layer's attention with its own options: ``forward`` (or ``forward_rows`` for ``rows``), or,
        for a window or a soft cap, the general path over the stored K/V."""
        if not spec.masked:
            scale = () if spec.scale is None else (spec.scale,)  # a backend may take the default scale only
            if rows is None:
                return self.forward(q, k, v, layer_kv, meta, *scale)
            return self.forward_rows(q, k, v, layer_kv, meta, rows, *scale)
        self.pool.store(layer_kv, meta.slot_mapping, k, v)
        out = attend_general(self.pool, q, layer_kv, meta, spec)
        return out if rows is None else out[rows]

    def warm_up(self, num_heads: int) -> None:
        """Compile what the first steps would otherwise compile on the way (called once the runner has
        set ``prefill_dtype``; ``num_heads``: the model's query heads); nothing by default."""

    def attends_bf16(self, meta: AttentionMetadata) -> bool:
        """Whether this step's rows attend in bf16 (``prefill_dtype``) with no row for the native decode
        stack: then a layer may keep q/k/v in bf16 from its GEMM into attention."""
        return self.prefill_dtype == torch.bfloat16 and self.native_step(meta) is None

    def native_step(self, meta: AttentionMetadata) -> NativeAttention | None:
        """The arguments of the native paged kernel when it can attend every row of this step
        (then the model may run whole layers natively); None, the default, when it cannot."""
        return None


_BACKENDS: Registry[AttentionBackend] = Registry("attention backend", "attention_backend")
register_attention_backend = _BACKENDS.register  # (name, cls)
get_attention_backend = _BACKENDS.get  # (name) -> cls; InvalidArgumentError listing the names
attention_backend_names = _BACKENDS.names
