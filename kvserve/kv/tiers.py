"""Offload tiers below device memory: evicted KV blocks kept in host RAM (here), on disk
(``disk_tier``, a directory replicas may share) and in Redis (``redis_tier``).

A tier stores opaque payloads (the bytes of one block's keys and values, all layers, as
the runner read them) under the block's chain hash, which covers every token of its
prefix and the model fingerprint. The disk tier writes through (every block offloaded
from the device also lands on disk), so it holds what the host tier dropped and survives
a restart. A disk entry repeats its fingerprint and tokens and carries a checksum: one
that does not match is a miss (and is deleted), never wrong output.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from itertools import groupby
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_MAGIC = b"KVSB1"
Tier = Any  # HostTier | kvserve.kv.disk_tier.DiskTier | kvserve.kv.redis_tier.RedisTier: name, stats, get, put, __contains__, read_seconds


@dataclass
class TierStats:
    hits: int = 0  # blocks found
    bytes_in: int = 0  # bytes stored into the tier
    bytes_out: int = 0  # bytes restored from it
    dropped: int = 0  # blocks pushed out by its capacity
    corrupt: int = 0  # entries rejected by the checksum, fingerprint or tokens


class HostTier:
    """An LRU of block payloads in host memory, bounded in bytes."""

    name = "host"

    def __init__(self, capacity_bytes: int, bandwidth: float = 5e9, latency: float = 20e-6):
        self.capacity_bytes = capacity_bytes
        self.bandwidth, self.latency = bandwidth, latency
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()
        self.used_bytes = 0
        self.stats = TierStats()

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes, tokens: Sequence[int]) -> bytes | None:
        payload = self._entries.get(key)
        if payload is not None:
            self._entries.move_to_end(key)
        return payload

    def put(self, key: bytes, tokens: Sequence[int], payload: bytes) -> None:
        if len(payload) > self.capacity_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.used_bytes -= len(old)
        while self.used_bytes + len(payload) > self.capacity_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.used_bytes -= len(dropped)
            self.stats.dropped += 1
        self._entries[key] = payload
        self.used_bytes += len(payload)
        self.stats.bytes_in += len(payload)

    def read_seconds(self, nbytes: int, nblocks: int) -> float:
        return nblocks * self.latency + nbytes / self.bandwidth

    def clear(self) -> None:
        """Forget every entry (they were computed by weights the engine no longer has)."""
        self._entries.clear()
        self.used_bytes = 0


def encode_entry(fingerprint: bytes, tokens: Sequence[int], payload: bytes) -> bytes:
    """A block as the disk and Redis tiers store it: magic, header length, header (the KV layout's
    fingerprint, the block's tokens, the payload's sha256), payload."""
    header = _header(fingerprint, tokens, payload)
    return _MAGIC + struct.pack("<I", len(header)) + header + payload


def decode_entry(data: bytes, fingerprint: bytes, tokens: Sequence[int]) -> bytes | None:
    """The payload of an entry written by ``encode_entry`` for these tokens and this fingerprint;
    None for anything else (corrupt, truncated, another model's or layout's, another block's)."""
    if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + 4:
        return None
    (hlen,) = struct.unpack_from("<I", data, len(_MAGIC))
    start = len(_MAGIC) + 4
    header = data[start : start + hlen]
    payload = data[start + hlen :]
    return payload if header == _header(fingerprint, tokens, payload) else None


def _header(fingerprint: bytes, tokens: Sequence[int], payload: bytes) -> bytes:
    return (struct.pack("<I", len(fingerprint)) + fingerprint
            + struct.pack(f"<I{len(tokens)}I", len(tokens), *tokens)
            + hashlib.sha256(payload).digest())


class TieredStore:
    """Host, disk, then Redis: ``put`` writes to every tier, a lookup reads from the first that has it.

    Tiers answer ``key in tier`` and ``get``; a remote tier (``remote = True``: Redis) also answers
    ``count_present`` and ``get_many``, one round trip for a whole chain of blocks.
    """

    def __init__(self, tiers: Sequence[Tier]):
        self.tiers = list(tiers)

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def put(self, key: bytes, tokens: Sequence[int], payload: bytes) -> None:
        for t in self.tiers:
            t.put(key, tokens, payload)

    def find_chain(self, keys: Sequence[bytes]) -> list[Tier]:
        """The tiers holding the leading blocks of a chain (``keys`` in order), up to the first block
        no tier holds. Local tiers are asked block by block; from the first block they lack, each
        remote tier is asked for the rest in one round trip (its leading run is taken)."""
        local = [t for t in self.tiers if not getattr(t, "remote", False)]
        remote = [t for t in self.tiers if getattr(t, "remote", False)]
        found: list[Tier] = []
        for i, key in enumerate(keys):
            tier = next((t for t in local if key in t), None)
            if tier is not None:
                found.append(tier)
                continue
            for r in remote:
                n = r.count_present(keys[i:])
                if n:
                    return found + [r] * n
            break
        return found

    def fetch(self, found: Sequence[tuple[bytes, tuple[int, ...], Tier]]) -> list[bytes | None]:
        """The payloads of ``found`` blocks ((key, tokens, tier), in order), up to the first miss (None):
        a remote tier's run of blocks in one round trip, a local tier's one block at a time."""
        out: list[bytes | None] = []
        for tier, run in groupby(found, key=lambda f: f[2]):
            items = [(k, t) for k, t, _ in run]
            payloads = tier.get_many(items) if getattr(tier, "remote", False) else (tier.get(k, t) for k, t in items)
            for payload in payloads:
                out.append(payload)
                if payload is None:  # the chain breaks here: read no further
                    return out
        return out
