"""The disk KV tier: one file per block in a directory that several processes may share.

Replicas on one machine, or on several over an NFS/Ceph mount, and restarts of either, may
point ``--kv-offload-dir`` at the same directory. What makes that safe:

- **Atomic entries.** A block is written to a temporary file with a name no other writer uses,
  in the same directory, then renamed onto ``<chain hash>.kvb`` (``os.replace``): a reader sees
  a whole entry or none. Each entry carries the fingerprint, the block's tokens and a sha256 of
  the payload (``tiers.encode_entry``), so a torn, truncated or foreign file (a crash before the
  data reached the disk, another model's or layout's entry) reads as a miss, never as wrong KV,
  and never raises into the engine. No fsync: the checksum already catches what it would prevent.
- **One size cap for all.** The bytes the directory holds are counted in its lock file
  (``.kvserve-disk-tier.lock``), updated under ``fcntl.flock`` by whoever adds or deletes an
  entry. A writer that would pass the cap lists the directory (under the lock) and deletes the
  least recently used entries (by mtime) until it fits, with some room to spare so that the
  next writers need not list it again; the listing also corrects the count (a writer that
  crashed between its rename and its count update). Files vanishing under a listing (another
  process's deletes) are skipped.
- **LRU across processes.** A hit sets the file's mtime to now (``os.utime``), so an entry any
  replica reads stays.

A directory that cannot be written (full, read-only) turns the tier off with one warning.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvserve.kv.tiers import TierStats, decode_entry, encode_entry

log = logging.getLogger("kvserve.kv.tiers")

LOCK_NAME = ".kvserve-disk-tier.lock"
SUFFIX = ".kvb"
EVICT_AHEAD = 1 / 32  # an eviction frees this fraction of the cap beyond what the new entry needs
STALE_TMP_S = 3600.0  # temporary files older than this are a crashed writer's: deleted by a listing
RECOUNT_S = 60.0  # a writer lists the directory at least this often, so a wrong count does not last
_COUNT = struct.Struct("<Q")


class DiskTier:
    """Blocks as files named by their chain hash under ``directory``; LRU by mtime, capped in bytes
    across every process that shares the directory.

    ``shared``: other replicas read this directory, so blocks are saved as soon as they are computed
    (``write_through``, as the Redis tier does), not only when the device evicts them.
    """

    name = "disk"

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, fingerprint: bytes, *,
                 shared: bool = False, bandwidth: float = 1e9, latency: float = 200e-6):
        self.dir = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.write_through = shared
        self.bandwidth, self.latency = bandwidth, latency
        self.stats = TierStats()
        self.enabled = True
        self._lock_fd = -1
        self._recounted_at = 0.0
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
            with self._locked():
                self._write_count(self._scan())
        except OSError as e:
            self._disable(e)

    def __del__(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)

    # -- paths, the lock and the count ---------------------------------------------------
    def _path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}{SUFFIX}"

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _read_count(self) -> int | None:
        data = os.pread(self._lock_fd, _COUNT.size, 0)
        return _COUNT.unpack(data)[0] if len(data) == _COUNT.size else None

    def _write_count(self, used: int) -> None:
        os.pwrite(self._lock_fd, _COUNT.pack(max(0, used)), 0)

    def _add_to_count(self, delta: int) -> None:
        """Adjust the shared count (caller holds the lock)."""
        used = self._read_count()
        self._write_count(self._scan() if used is None else used + delta)

    def _entries(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every entry; stale temporary files are deleted on the way."""
        out = []
        now = time.time()
        with os.scandir(self.dir) as it:
            for e in it:
                try:
                    if e.name.endswith(SUFFIX):
                        st = e.stat()
                        out.append((st.st_mtime, st.st_size, Path(e.path)))
                    elif e.name.endswith(".tmp") and now - e.stat().st_mtime > STALE_TMP_S:
                        os.unlink(e.path)
                except FileNotFoundError:  # deleted by another process meanwhile
                    continue
        return out

    def _scan(self) -> int:
        self._recounted_at = time.monotonic()
        return sum(size for _, size, _ in self._entries())

    def _make_room(self, need: int) -> int:
        """Delete the least recently used entries until ``need`` more bytes fit under the cap, and a
        little more (caller holds the lock); returns the bytes the directory then holds."""
        entries = sorted(self._entries())
        used = sum(size for _, size, _ in entries)
        target = self.capacity_bytes - need - int(self.capacity_bytes * EVICT_AHEAD)
        for _, size, path in entries:
            if used <= target:
                break
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            used -= size
            self.stats.dropped += 1
        self._recounted_at = time.monotonic()
        return used

    def _disable(self, err: OSError) -> None:
        if self.enabled:
            log.warning("KV disk tier at %s turned off: %s", self.dir, err)
        self.enabled = False

    # -- the tier interface --------------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return self.enabled and self._path(key).exists()

    def __len__(self) -> int:
        return sum(1 for p in self.dir.glob(f"*{SUFFIX}")) if self.enabled else 0

    def knows(self, key: bytes) -> bool:
        """Whether the directory holds ``key`` already (written by any process): no need to save it."""
        return key in self

    def get(self, key: bytes, tokens: Sequence[int]) -> bytes | None:
        """The block's payload, or None: absent, vanished, or not a whole entry of this block."""
        if not self.enabled:
            return None
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
                inode = os.fstat(f.fileno()).st_ino
        except OSError:  # absent, or deleted by another process since it was found
            return None
        payload = decode_entry(data, self.fingerprint, tokens)
        if payload is None:
            self.stats.corrupt += 1
            log.warning("KV disk tier: ignoring a corrupt or foreign entry %s", path.name)
            self._delete_bad(path, inode, len(data))
            return None
        try:
            os.utime(path)  # most recently used, for every process's eviction
        except OSError:
            pass
        return payload

    def _delete_bad(self, path: Path, inode: int, size: int) -> None:
        """Delete a bad entry, unless another writer has replaced it since it was read."""
        try:
            with self._locked():
                if os.stat(path).st_ino == inode:
                    path.unlink()
                    self._add_to_count(-size)
        except OSError:
            pass

    def put(self, key: bytes, tokens: Sequence[int], payload: bytes) -> None:
        path = self._path(key)
        if not self.enabled or path.exists():  # (perhaps written by another replica)
            return
        data = encode_entry(self.fingerprint, tokens, payload)
        if len(data) > self.capacity_bytes:
            return
        tmp = self.dir / f".{key.hex()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            tmp.write_bytes(data)  # outside the lock: a slow disk holds up no other writer
            with self._locked():
                if path.exists():
                    tmp.unlink()
                else:
                    used = self._read_count()
                    if used is None or time.monotonic() - self._recounted_at > RECOUNT_S:
                        used = self._scan()
                    if used + len(data) > self.capacity_bytes:
                        used = self._make_room(len(data))
                    os.replace(tmp, path)
                    self._write_count(used + len(data))
                    self.stats.bytes_in += len(payload)
        except OSError as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self._disable(e)

    def read_seconds(self, nbytes: int, nblocks: int) -> float:
        return nblocks * self.latency + nbytes / self.bandwidth
