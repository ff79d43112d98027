"""Attention on the paged KV cache: the KV pool that owns the cache tensors, and the backends
that attend over it, each chosen by name from a registry (``--kv-cache-dtype``,
``--attention-backend``; ``auto`` picks one for the device and KV dtype)."""

from kvserve.attention.backend import (
    DEFAULT_ATTENTION_BACKEND,
    AttentionBackend,
    AttentionMetadata,
    SeqRows,
    attention_backend_names,
    get_attention_backend,
    register_attention_backend,
)
from kvserve.attention.kv_pool import KVPool, LayerKV, get_kv_pool, kv_pool_names, register_kv_pool
from kvserve.attention import paged, quantized_pool, sdpa  # noqa: F401  (register the backends and 8-bit pools)
from kvserve.attention.auto import choose_attention_backend

__all__ = [
    "DEFAULT_ATTENTION_BACKEND",
    "AttentionBackend",
    "AttentionMetadata",
    "KVPool",
    "LayerKV",
    "SeqRows",
    "attention_backend_names",
    "choose_attention_backend",
    "get_attention_backend",
    "get_kv_pool",
    "kv_pool_names",
    "register_attention_backend",
    "register_kv_pool",
]
