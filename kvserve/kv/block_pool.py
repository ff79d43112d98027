"""A pool of fixed-size KV blocks with reference counts and per-sequence block tables."""

from __future__ import annotations

from collections import deque

# The id a block table holds where a sliding window let go of the block: keeps the table's length
# aligned with positions; nothing reads it (attention starts at the window).
NO_BLOCK = -1


class BlockPool:
    """Hands out KV block ids; a block returns to the free list when its last holder lets go.

    Block ids index the first dimension of the runner's KV tensors. Reference counts let
    several holders share a block: the sequences using it and, for a block in the prefix
    cache, the cache itself. The pool counts the cached blocks that only the cache holds,
    which is what eviction could free.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._cached = [False] * num_blocks
        self.num_evictable = 0  # cached blocks whose only holder is the cache

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """How many blocks hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, block: int) -> None:
        assert self._refs[block] > 0, "sharing a free block"
        if self._cached[block] and self._refs[block] == 1:
            self.num_evictable -= 1
        self._refs[block] += 1

    def mark_cached(self, block: int, cached: bool) -> None:
        """The prefix cache took (or dropped) its reference on ``block``."""
        if self._cached[block] != cached and self._refs[block] == 1:
            self.num_evictable += 1 if cached else -1
        self._cached[block] = cached

    def is_cached(self, block: int) -> bool:
        return self._cached[block]

    def release(self, blocks: list[int]) -> None:
        # Free in reverse so a sequence's tail blocks are reused first (its head may be shared).
        for b in reversed(blocks):
            assert self._refs[b] > 0, f"double free of block {b}"
            self._refs[b] -= 1
            if self._refs[b] == 0:
                assert not self._cached[b], f"cached block {b} lost its cache reference"
                self._free.append(b)
            elif self._refs[b] == 1 and self._cached[b]:
                self.num_evictable += 1

    def ref_count(self, block: int) -> int:
        return self._refs[block]
