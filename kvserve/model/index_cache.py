"""Where a lightning indexer's keys live in the KV pool (DeepSeek-V3.2, GLM-5: ``ModelConfig.index_topk``): packed
index_head_dim values at a time into the K and V rows of pool layers after the model's own, as many layers' keys in one
as fit (a K or V row holds num_key_value_heads x head_dim values), so that they cost a fraction of a pool layer a token
rather than one each. Torch-free: the KV layout's layer count (``ModelConfig.kv_cache_layers``) reads it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.model.config import ModelConfig


def _per_row(cfg: "ModelConfig") -> int:
    """Indexers' keys one K (or V) row holds."""
    return cfg.num_key_value_heads * int(cfg.head_dim or 0) // cfg.index_head_dim


def index_pool_layers(cfg: "ModelConfig") -> int:
    """The pool layers every indexer's keys take (0 without an indexer)."""
    if not cfg.index_topk:
        return 0
    indexers = sum(cfg.runs_indexer(i) for i in range(cfg.num_hidden_layers))
    return -(-indexers // (2 * _per_row(cfg)))


def index_slot(cfg: "ModelConfig", layer: int) -> tuple[int, int, int]:
    """Where ``layer``'s indexer keeps its keys: (pool layer, 0 for K's row or 1 for V's, offset in the row)."""
    n = sum(cfg.runs_indexer(i) for i in range(layer))
    per = _per_row(cfg)
    own = sum(cfg.cache_layers(i) for i in range(cfg.num_hidden_layers))
    return own + n // (2 * per), (n // per) % 2, (n % per) * cfg.index_head_dim
