"""The router's backends: each one's health, load, and mirror of its prefix cache (``Backend``, ``BackendSet``).

A backend is a kvserve server (a replica) named by its base URL. The router keeps, per backend,
the set of block hashes its prefix cache holds, kept exact by applying the replica's
``GET /kv/events`` answers in order (a ``reset`` answer replaces the set), the load it reported
there, and the requests this router has in flight on it (which it knows without delay).

It also remembers its own recent decisions (``Prediction``): the prompt blocks of each request it
sent there and that has not finished, which the replica is computing (or holding for another
request that computes them) and will cache, though it has not said so yet; and the prompt tokens
of those requests it predicted the replica had to compute, until their first byte comes back.
Followers of a prefix still being computed then go where it is being computed, and a new
request sees how much prefill work is queued ahead of it on each backend.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvserve.errors import InvalidArgumentError
from kvserve.router.prefix import HashScheme


def normalize_url(url: str) -> str:
    """``http://host:port`` without a trailing slash; a 400 for anything that is not an http(s) URL."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise InvalidArgumentError(f"a backend is an http(s) URL such as http://127.0.0.1:8001, got {url!r}",
                                   param="url")
    return url


@dataclass(eq=False)
class Prediction:
    """What one request routed to a backend adds to the router's view of it, until it ends."""

    blocks: list[bytes]  # its prompts' block hashes in that backend's scheme
    queued_tokens: int  # its prompt tokens predicted not cached there: prefill work, until its first byte
    prefilled: bool = False
    finished: bool = False


class CacheView:
    """A backend's reported cache and the blocks its requests in flight are computing, as one container."""

    def __init__(self, cached: set[bytes], computing: Counter[bytes]):
        self.cached = cached
        self.computing = computing

    def __contains__(self, h: object) -> bool:
        return h in self.cached or h in self.computing


@dataclass(eq=False)
class Backend:
    url: str
    healthy: bool = True  # until a check says otherwise
    failures: int = 0  # failed health checks in a row
    in_flight: int = 0  # this router's requests on it
    # its prefix cache, from GET /kv/events
    replica_id: str = ""
    epoch: str | None = None
    seq: int | None = None
    scheme: HashScheme | None = None
    cached: set[bytes] = field(default_factory=set)
    synced: bool = False  # the set is up to date with some answer of this epoch
    # its load, as it last reported it
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    adapters: frozenset[str] = frozenset()  # the LoRA adapters it has loaded
    # this router's requests on it, predicted (Prediction)
    computing: Counter[bytes] = field(default_factory=Counter)  # blocks of its requests in flight
    queued_tokens: int = 0  # prompt tokens predicted to be computed there before a new request's

    @property
    def cache_view(self) -> CacheView:
        """The blocks a request sent now would find: the reported cache and what is being computed."""
        return CacheView(self.cached, self.computing)

    def predict(self, blocks: list[bytes], queued_tokens: int) -> Prediction:
        """A request was sent here: its blocks will be cached, its uncached tokens are queued work."""
        self.computing.update(blocks)
        self.queued_tokens += queued_tokens
        return Prediction(blocks, queued_tokens)

    def prefilled(self, p: Prediction) -> None:
        """The request's first byte came back: its prefill is no longer work ahead of others."""
        if not p.prefilled:
            p.prefilled = True
            self.queued_tokens -= p.queued_tokens

    def finished(self, p: Prediction) -> None:
        """The request ended (or failed): its blocks are in the reported cache by now, or never will be."""
        self.prefilled(p)
        if not p.finished:
            p.finished = True
            self.computing.subtract(p.blocks)
            for h in p.blocks:
                if self.computing[h] <= 0:
                    del self.computing[h]

    @property
    def load(self) -> int:
        """Requests in flight there: what it reported, or this router's own count when higher (fresher)."""
        return max(self.in_flight, self.running + self.waiting)

    def apply_events(self, body: dict[str, Any]) -> None:
        """Bring the mirror up to date with one ``GET /kv/events`` answer."""
        epoch = body.get("epoch")
        if not body.get("reset") and (epoch != self.epoch or not self.synced):
            raise ValueError("an incremental answer for a mirror that is not in step with it")
        if body.get("reset"):
            self.cached = set()
        self.cached.difference_update(bytes.fromhex(h) for h in body.get("removed", ()))
        self.cached.update(bytes.fromhex(h) for h in body.get("stored", ()))
        self.epoch, self.seq, self.synced = epoch, int(body["seq"]), True
        self.replica_id = str(body.get("replica_id", ""))
        self.scheme = HashScheme.from_json(body.get("hash_scheme") or {}) if body.get("enabled", True) else None
        self.adapters = frozenset(str(a) for a in body.get("lora_adapters") or ())
        load = body.get("load")
        if load:
            self.running = int(load.get("running", 0))
            self.waiting = int(load.get("waiting", 0))
            self.kv_usage = float(load.get("kv_usage", 0.0))

    def forget_cache(self) -> None:
        """The mirror may be stale (the backend went away): start again from a snapshot."""
        self.cached, self.synced, self.seq = set(), False, None

    def describe(self) -> dict[str, Any]:
        """Its state, for ``GET /admin/backends``."""
        return {"url": self.url, "healthy": self.healthy, "replica_id": self.replica_id, "in_flight": self.in_flight,
                "running": self.running, "waiting": self.waiting, "kv_usage": self.kv_usage,
                "lora_adapters": sorted(self.adapters),
                "cached_blocks": len(self.cached), "computing_blocks": len(self.computing),
                "queued_tokens": self.queued_tokens, "events_seq": self.seq, "synced": self.synced}


class BackendSet:
    """The backends by URL, in the order they were added."""

    def __init__(self, urls: Iterable[str] = ()):
        self._by_url: dict[str, Backend] = {}
        for url in urls:
            self.add(url)

    def add(self, url: str) -> tuple[Backend, bool]:
        """The backend at ``url``, and whether it is new."""
        url = normalize_url(url)
        if url in self._by_url:
            return self._by_url[url], False
        backend = self._by_url[url] = Backend(url)
        return backend, True

    def remove(self, url: str) -> Backend | None:
        return self._by_url.pop(normalize_url(url), None)

    def get(self, url: str) -> Backend | None:
        return self._by_url.get(url)

    def __iter__(self) -> Iterator[Backend]:
        return iter(list(self._by_url.values()))

    def __len__(self) -> int:
        return len(self._by_url)

    def healthy(self) -> list[Backend]:
        return [b for b in self._by_url.values() if b.healthy]
