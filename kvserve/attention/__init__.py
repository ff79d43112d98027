"""Attention on the paged KV cache: the KV pool that owns the cache tensors, and the backends
that attend over it, each chosen by name from a registry (``--kv-cache-dtype``,
``--attention-backend``)."""

from kvserve.attention.backend import (
    DEFAULT_ATTENTION_BACKEND,
    AttentionBackend,
    AttentionMetadata,
    SeqRows,
    attention_backend_names,
    get_attention_backend,
    register_attention_backend,
)
from kvserve.attention.kv_pool import KVPool, get_kv_pool, kv_pool_names, register_kv_pool
from kvserve.attention import sdpa  # noqa: F401  (registers the default backend)

__all__ = [
    "DEFAULT_ATTENTION_BACKEND",
    "AttentionBackend",
    "AttentionMetadata",
    "KVPool",
    "SeqRows",
    "attention_backend_names",
    "get_attention_backend",
    "get_kv_pool",
    "kv_pool_names",
    "register_attention_backend",
    "register_kv_pool",
]
