"""The replica's KV events (``KVEventLog``): what its prefix cache stored and removed, numbered, for a router.

The engine's step messages carry the chain hashes of the blocks its prefix cache stored and
removed since the previous message (``StepMessage.kv_stored`` / ``kv_removed``). This log keeps
them in the API process as numbered entries (one per message that changed something), bounded by
the number of hashes they hold, and mirrors the set they add up to: exactly the cache's set, since
the engine records from its first step. A reader asks for the changes after the sequence number it
has seen (``since``); one that is too far behind, from another run of the server (``epoch``), or
new, gets the whole set instead (``reset``). ``GET /kv/events`` serves it (server/routes/kv.py).
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from dataclasses import dataclass, field

HASH_ALGORITHM = "blake2b-128-chain"  # kvserve.kv.radix_cache.chain_hash
DEFAULT_MAX_LOGGED_HASHES = 1 << 16


@dataclass
class KVEventBatch:
    """What a reader gets: the changes after ``since`` up to ``seq``, or (``reset``) the whole set."""

    seq: int
    reset: bool
    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)


class KVEventLog:
    """Numbered changes to a replica's cached block hashes, and the set they add up to."""

    def __init__(self, block_size: int, root_key: bytes = b"", *, enabled: bool = True,
                 max_hashes: int = DEFAULT_MAX_LOGGED_HASHES):
        self.block_size = block_size
        self.root_key = root_key
        self.enabled = enabled
        self.max_hashes = max_hashes
        self.epoch = uuid.uuid4().hex  # this run of the log: sequence numbers mean nothing across runs
        self.seq = 0
        self.cached: set[bytes] = set()
        self._entries: deque[tuple[int, list[bytes], list[bytes]]] = deque()
        self._logged = 0  # hashes held by _entries
        self._dropped_upto = 0  # the last sequence number no longer in _entries
        self._changed: asyncio.Event | None = None  # created on the loop by the first waiter

    def apply(self, stored: list[bytes], removed: list[bytes]) -> None:
        """One step message's changes (a hash is in one of the two lists at most)."""
        if not stored and not removed:
            return
        self.seq += 1
        self.cached.difference_update(removed)
        self.cached.update(stored)
        self._entries.append((self.seq, stored, removed))
        self._logged += len(stored) + len(removed)
        while self._logged > self.max_hashes and len(self._entries) > 1:
            seq, s, r = self._entries.popleft()
            self._logged -= len(s) + len(r)
            self._dropped_upto = seq
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def clear(self) -> None:
        """The cache is gone (the engine died): nothing is cached, and readers start again."""
        self.epoch = uuid.uuid4().hex
        self.seq, self._logged, self._dropped_upto = 0, 0, 0
        self.cached.clear()
        self._entries.clear()

    def since(self, seq: int | None, epoch: str | None = None) -> KVEventBatch:
        """The changes after ``seq``; the whole set when ``seq`` is None, from another epoch, ahead
        of this log, or older than what the log still holds."""
        if seq is None or (epoch is not None and epoch != self.epoch) or seq > self.seq or seq < self._dropped_upto:
            return KVEventBatch(self.seq, True, list(self.cached))
        newer = []
        for entry in reversed(self._entries):  # newest first, so a reader close behind costs little
            if entry[0] <= seq:
                break
            newer.append(entry)
        # hash -> (cached at ``seq``, cached now): a hash stored and removed since is no news
        changes: dict[bytes, tuple[bool, bool]] = {}
        for _, stored, removed in reversed(newer):
            for k in removed:
                prev = changes.get(k)
                changes[k] = (prev[0] if prev is not None else True, False)
            for k in stored:
                prev = changes.get(k)
                changes[k] = (prev[0] if prev is not None else False, True)
        return KVEventBatch(self.seq, False, [k for k, (was, now) in changes.items() if now and not was],
                            [k for k, (was, now) in changes.items() if was and not now])

    async def wait_after(self, seq: int, timeout: float) -> None:
        """Return once the log is past ``seq``, or after ``timeout`` seconds (a reader's long poll)."""
        if self.seq != seq or timeout <= 0:
            return
        if self._changed is None:
            self._changed = asyncio.Event()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def hash_scheme(self) -> dict[str, object]:
        """What a router needs to name a prompt's blocks as this cache does."""
        return {"algorithm": HASH_ALGORITHM, "root_key": self.root_key.hex(), "block_size": self.block_size,
                "token_bytes": 4, "byteorder": "little",
                # the last prompt token is always computed (its logits are needed), so a prompt's
                # blocks are matched over all its tokens but the last
                "match": "prompt[:-1]"}
