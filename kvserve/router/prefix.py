"""A prompt's blocks named as a replica's prefix cache names them, and how much of the prompt a cache holds.

A replica's cache names each full block by a chain hash of every token up to its end, seeded with
the model fingerprint (``kvserve.kv.radix_cache.chain_hash``; the seed and block size come from
the replica's ``GET /kv/events``). Admission matches a prompt's blocks over all its tokens but the
last, whose logits must be computed, so a prompt's cached prefix on a replica is its leading
blocks of ``prompt[:-1]`` whose hashes that replica holds. No torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.kv.radix_cache import chain_hash
from kvserve.server.kv_events import HASH_ALGORITHM


@dataclass(frozen=True)
class HashScheme:
    """How one replica names its blocks."""

    root_key: bytes
    block_size: int

    @classmethod
    def from_json(cls, scheme: dict[str, Any]) -> HashScheme | None:
        """From ``hash_scheme`` of ``GET /kv/events``; None for a scheme this router cannot compute."""
        if scheme.get("algorithm") != HASH_ALGORITHM or scheme.get("token_bytes", 4) != 4:
            return None
        try:
            block_size = int(scheme["block_size"])
            root_key = bytes.fromhex(scheme.get("root_key", ""))
        except (KeyError, TypeError, ValueError):
            return None
        return cls(root_key, block_size) if block_size >= 1 else None


def block_hashes(token_ids: Sequence[int], scheme: HashScheme) -> list[bytes]:
    """The chain hashes of the full blocks of ``token_ids[:-1]``: the blocks a replica could reuse."""
    bs = scheme.block_size
    n = (len(token_ids) - 1) // bs if token_ids else 0
    out: list[bytes] = []
    key = scheme.root_key
    for i in range(n):
        key = chain_hash(key, token_ids[i * bs : (i + 1) * bs])
        out.append(key)
    return out


def cached_tokens(hashes: Sequence[bytes], cached: Container[bytes], block_size: int) -> int:
    """Tokens at the start of the prompt whose blocks (``hashes``, in order) are in ``cached``."""
    n = 0
    for h in hashes:
        if h not in cached:
            break
        n += 1
    return n * block_size


class PromptHashes:
    """One request's prompts hashed once per scheme (replicas of one model share theirs)."""

    def __init__(self, prompts: Sequence[Sequence[int]]):
        self.prompts = prompts
        self._by_scheme: dict[HashScheme, list[list[bytes]]] = {}

    @property
    def num_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def hashes(self, scheme: HashScheme) -> list[list[bytes]]:
        """Each prompt's block hashes in ``scheme``."""
        hashes = self._by_scheme.get(scheme)
        if hashes is None:
            hashes = self._by_scheme[scheme] = [block_hashes(p, scheme) for p in self.prompts]
        return hashes

    def cached_tokens(self, scheme: HashScheme | None, cached: Container[bytes]) -> int:
        """Tokens of all the prompts predicted to be in a cache with ``scheme`` holding ``cached``."""
        if scheme is None or not self.prompts:
            return 0
        return sum(cached_tokens(h, cached, scheme.block_size) for h in self.hashes(scheme))
