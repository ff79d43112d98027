"""What the prefix cache stored and removed since it was last asked: the source of a replica's KV events.

A router that predicts where a prompt's prefix is cached mirrors each replica's set of cached
blocks, named by their chain hashes (``radix_cache.chain_hash``). The cache reports each node it
adds (a block just computed, or one restored from a tier) and each node it drops (eviction drops
a subtree, blocks still used by requests included: they can no longer be matched); the engine
core takes the changes once per step message. Only the net change of each hash is kept, so a
block stored and evicted within one step costs nothing downstream.
"""

from __future__ import annotations


class CacheEvents:
    """Net changes to the set of cached chain hashes since the last ``take``."""

    __slots__ = ("_changes",)

    def __init__(self) -> None:
        # hash -> (cached before the first change, cached now)
        self._changes: dict[bytes, tuple[bool, bool]] = {}

    def stored(self, key: bytes) -> None:
        self._set(key, True)

    def removed(self, key: bytes) -> None:
        self._set(key, False)

    def _set(self, key: bytes, present: bool) -> None:
        prev = self._changes.get(key)
        self._changes[key] = (prev[0] if prev is not None else not present, present)

    def __bool__(self) -> bool:
        return bool(self._changes)

    def take(self) -> tuple[list[bytes], list[bytes]]:
        """The hashes stored and the hashes removed since the last call (each in one list at most)."""
        changes, self._changes = self._changes, {}
        stored = [k for k, (before, now) in changes.items() if now and not before]
        removed = [k for k, (before, now) in changes.items() if before and not now]
        return stored, removed
