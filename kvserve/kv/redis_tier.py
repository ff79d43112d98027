"""A KV tier in Redis, shared by replicas (the role LMCache's remote store plays).

Blocks are stored under their chain hash (which covers the model fingerprint and every token of
the prefix) with the disk tier's entry format: fingerprint, tokens and a checksum, so a corrupt or
foreign value is a miss (and is deleted), never wrong output. Redis does the eviction: run it with
``maxmemory`` and ``maxmemory-policy allkeys-lru`` (docs/kv-tiers.md).

Lookups batch a whole chain: ``count_present`` (EXISTS in one pipeline) and ``get_many`` (one MGET).
Writes leave the engine's step path: ``put`` queues the entry for a writer thread that sends the
queue in pipelines (SET NX), and a full queue drops the newest entry. Unlike the host and disk
tiers, which only take blocks evicted from the device, a shared tier also takes each block when it
is first computed (``write_through``), so that another replica can reuse it at once.

If Redis is unreachable or slow (a socket timeout), the tier turns itself off with one warning,
every lookup is a miss and every write is dropped; after ``retry_s`` it tries again, and says
when Redis is back. Requests never fail because of it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvserve.kv.tiers import TierStats, decode_entry, encode_entry

log = logging.getLogger(__name__)

KEY_PREFIX = b"kvserve:kv:"
WRITE_QUEUE_BLOCKS = 1024  # entries waiting for the writer; more are dropped
WRITE_BATCH = 32  # entries per pipeline
KNOWN_KEYS = 1 << 16  # keys remembered as present (skips saving what Redis already has)


class RedisTier:
    name = "redis"
    remote = True  # lookups batch a chain (kvserve.kv.tiers.TieredStore)
    write_through = True  # takes blocks when they are computed, not only when they are evicted

    def __init__(self, url: str, fingerprint: bytes, *, retry_s: float = 30.0, timeout_s: float = 0.5,
                 bandwidth: float = 1e9, latency: float = 200e-6, client: Any = None):
        import redis

        self.url = url
        self.fingerprint = fingerprint
        self.retry_s = retry_s
        self.bandwidth, self.latency = bandwidth, latency
        self.stats = TierStats()
        self._errors = (redis.RedisError, OSError)
        self._client = client or redis.Redis.from_url(url, socket_timeout=timeout_s,
                                                      socket_connect_timeout=timeout_s)
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._lock = threading.Lock()
        self._known: dict[bytes, None] = {}  # insertion-ordered: the oldest forgotten first
        self.written = 0  # entries the writer stored
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue(WRITE_QUEUE_BLOCKS)
        self._writer = threading.Thread(target=self._write_loop, name="kvserve-redis-tier", daemon=True)
        self._writer.start()

    # -- availability --------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """False while Redis is down and not yet due for another try."""
        with self._lock:
            if self._down_since is None:
                return True
            if time.monotonic() < self._retry_at:
                return False
            self._retry_at = time.monotonic() + self.retry_s
        try:
            self._client.ping()
        except self._errors:
            return False
        with self._lock:
            down, self._down_since = self._down_since, None
        log.warning("KV Redis tier at %s is back after %.0f s", self.url, time.monotonic() - (down or 0.0))
        return True

    def _failed(self, err: BaseException) -> None:
        with self._lock:
            if self._down_since is not None:
                return
            self._down_since = time.monotonic()
            self._retry_at = self._down_since + self.retry_s
        log.warning("KV Redis tier at %s turned off (%s: %s); requests go on without it, retrying every %.0f s",
                    self.url, type(err).__name__, err, self.retry_s)

    # -- lookups -------------------------------------------------------------------------
    def _key(self, key: bytes) -> bytes:
        return KEY_PREFIX + key.hex().encode()

    def __contains__(self, key: bytes) -> bool:
        return self.count_present([key]) == 1

    def __len__(self) -> int:
        return len(self._known)

    def count_present(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, Redis holds (one round trip)."""
        if not keys or not self.available:
            return 0
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._key(k))
            present = pipe.execute()
        except self._errors as e:
            self._failed(e)
            return 0
        n = 0
        while n < len(present) and present[n]:
            n += 1
        return n

    def get(self, key: bytes, tokens: Sequence[int]) -> bytes | None:
        return self.get_many([(key, tokens)])[0]

    def get_many(self, items: Sequence[tuple[bytes, Sequence[int]]]) -> list[bytes | None]:
        """The payloads of ``items`` ((key, tokens)) in one MGET; None for a miss or a bad entry."""
        if not items or not self.available:
            return [None] * len(items)
        try:
            values = self._client.mget([self._key(k) for k, _ in items])
        except self._errors as e:
            self._failed(e)
            return [None] * len(items)
        out: list[bytes | None] = []
        for (key, tokens), data in zip(items, values):
            payload = decode_entry(data, self.fingerprint, tokens) if data is not None else None
            if data is not None and payload is None:
                self.stats.corrupt += 1
                log.warning("KV Redis tier: ignoring a corrupt or foreign entry %s", key.hex())
                try:
                    self._client.delete(self._key(key))
                except self._errors as e:
                    self._failed(e)
            if payload is not None:
                self._remember(key)
            out.append(payload)
        return out

    # -- writes --------------------------------------------------------------------------
    def knows(self, key: bytes) -> bool:
        """Whether Redis is known to hold ``key`` already (written or read here): no need to save it."""
        return key in self._known

    def _remember(self, key: bytes) -> None:
        with self._lock:
            self._known[key] = None
            if len(self._known) > KNOWN_KEYS:
                del self._known[next(iter(self._known))]

    def put(self, key: bytes, tokens: Sequence[int], payload: bytes) -> None:
        if self.knows(key) or self._down_since is not None:
            return
        try:
            self._queue.put_nowait((key, encode_entry(self.fingerprint, tokens, payload)))
            self.stats.bytes_in += len(payload)
        except queue.Full:
            self.stats.dropped += 1

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until the queued writes are sent (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        self._queue.put(None)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            while len(batch) < WRITE_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            entries = [b for b in batch if b is not None]
            try:
                if entries and self._down_since is None:
                    pipe = self._client.pipeline(transaction=False)
                    for key, data in entries:
                        pipe.set(self._key(key), data, nx=True)
                    pipe.execute()
                    for key, _ in entries:
                        self._remember(key)
                    self.written += len(entries)
            except self._errors as e:
                self._failed(e)
            finally:
                for _ in batch:
                    self._queue.task_done()
            if None in batch:
                return

    def read_seconds(self, nbytes: int, nblocks: int) -> float:
        # one round trip for the chain, then the bytes
        return self.latency + nbytes / self.bandwidth
