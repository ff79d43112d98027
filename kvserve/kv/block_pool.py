"""A pool of fixed-size KV blocks with reference counts and per-sequence block tables."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out KV block ids; a block returns to the free list when its last holder lets go.

    Block ids index the first dimension of the runner's KV tensors. Reference counts let
    several sequences share a block (prefix sharing); today each block has one holder.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

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
        self._refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        # Free in reverse so a sequence's tail blocks are reused first (its head may be shared).
        for b in reversed(blocks):
            assert self._refs[b] > 0, f"double free of block {b}"
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._refs[block]


class KVManager:
    """Per-sequence block tables over a BlockPool.

    The scheduler asks it to make room for a sequence's next tokens and to free a
    sequence; it never sees tensors.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.tables: dict[str, list[int]] = {}

    def table(self, seq_id: str) -> list[int]:
        return self.tables.get(seq_id, [])

    def blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """Extra blocks a sequence needs so that it can hold ``num_tokens`` tokens in total."""
        return max(0, self.pool.blocks_for(num_tokens) - len(self.table(seq_id)))

    def can_grow(self, seq_id: str, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= self.pool.num_free

    def grow(self, seq_id: str, num_tokens: int) -> None:
        """Make the sequence's table cover ``num_tokens`` tokens; caller checked ``can_grow``."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need:
            self.tables.setdefault(seq_id, []).extend(self.pool.allocate(need))

    def free(self, seq_id: str) -> None:
        blocks = self.tables.pop(seq_id, None)
        if blocks:
            self.pool.release(blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free
