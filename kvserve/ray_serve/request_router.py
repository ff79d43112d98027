"""kvserve's routing policy as a Ray Serve ``RequestRouter`` (``CacheAwareRequestRouter``).

Ray Serve asks a deployment's request router, for each call through a deployment handle, which
replicas to try (``choose_replicas``, ranked). This one answers with the replica kvserve's own
policy picks (``kvserve.router.policy``: by default ``cache-aware``, the longest cached prefix of
the prompt unless that replica carries more than ``max_load_imbalance`` requests beyond the least
loaded one; ties to the one picked least recently), then the others as a fallback rank.

What it knows of each replica:
- its prefix cache: the chain hashes of the blocks it holds, and how to compute them, from the
  replica's ``record_routing_stats`` (``replica.py``), which Ray Serve's controller pulls every
  ``request_routing_stats_period_s`` and pushes to the routers. A prompt's cached tokens on a
  replica are computed as ``kvserve router`` does (``kvserve.router.prefix``), from the token ids
  the ingress put in the ``ReplicaCall``.
- its load: Ray Serve's own count of requests ongoing on it (the router's queue-length cache,
  probed when stale), which is never older than the last call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvserve.ray_serve.call import ReplicaCall
from kvserve.router.policy import DEFAULT_MAX_IMBALANCE, Candidate, Policy, holding_adapter, make_policy
from kvserve.router.prefix import HashScheme, PromptHashes

log = logging.getLogger("kvserve.ray_serve")

STATS_KEY = "kvserve"  # the replica's routing stats: {"kvserve": {...}} (replica.py: cache_stats)
HASH_BYTES = 16  # a chain hash (blake2b-128)


@dataclass(frozen=True)
class ReplicaCache:
    """One replica's prefix cache as its routing stats describe it."""

    scheme: HashScheme | None
    cached: frozenset[bytes]

    @classmethod
    def from_stats(cls, stats: dict[str, Any] | None) -> ReplicaCache:
        """From a replica's routing stats (an empty cache for stats without ours, or malformed)."""
        mine = (stats or {}).get(STATS_KEY)
        if not isinstance(mine, dict):
            return EMPTY
        blob = mine.get("cached")
        if not isinstance(blob, bytes | bytearray) or len(blob) % HASH_BYTES:
            return EMPTY
        scheme = HashScheme.from_json(mine.get("hash_scheme") or {})
        return cls(scheme, frozenset(bytes(blob[i:i + HASH_BYTES]) for i in range(0, len(blob), HASH_BYTES)))


EMPTY = ReplicaCache(None, frozenset())


def call_of(pending_request: PendingRequest | None) -> ReplicaCall | None:
    """The ``ReplicaCall`` a pending request carries (None for other calls)."""
    if pending_request is None:
        return None
    for arg in list(pending_request.args or ()) + list((pending_request.kwargs or {}).values()):
        if isinstance(arg, ReplicaCall):
            return arg
    return None


class CacheAwareRequestRouter(RequestRouter):
    """Ray Serve's request router for kvserve replicas: kvserve's routing policy over Ray's replicas.

    ``request_router_kwargs``: ``policy`` (cache-aware, least-load, round-robin, session) and
    ``max_load_imbalance``, as ``kvserve router``'s flags.
    """

    def initialize_state(self, policy: str = "cache-aware", max_load_imbalance: int = DEFAULT_MAX_IMBALANCE,
                         **_: Any) -> None:
        self.policy: Policy = make_policy(policy, max_load_imbalance)
        self._caches: dict[ReplicaID, tuple[Any, ReplicaCache]] = {}  # replica -> (its stats' blob, parsed)

    def cache_of(self, replica: RunningReplica) -> ReplicaCache:
        """The replica's cache, parsed once per new routing stats."""
        stats = replica.routing_stats
        blob = ((stats or {}).get(STATS_KEY) or {}).get("cached")
        seen = self._caches.get(replica.replica_id)
        if seen is not None and seen[0] is blob:
            return seen[1]
        cache = ReplicaCache.from_stats(stats)
        self._caches[replica.replica_id] = (blob, cache)
        return cache

    async def loads(self, replicas: Sequence[RunningReplica]) -> dict[ReplicaID, int]:
        """Requests ongoing on each replica that answers: Ray's cached queue lengths, probed where stale."""
        out: dict[ReplicaID, int] = {}
        stale = []
        for r in replicas:
            n = self.replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if n is None:
                stale.append(r)
            else:
                out[r.replica_id] = n
        if stale:
            for r, n in await self._probe_queue_lens(stale, 0):
                if n is not None:
                    out[r.replica_id] = n
        return out

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:  # if none of the ranks takes it, Ray backs off before asking again
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        loads = await self.loads(candidate_replicas)
        open_ = [r for r in candidate_replicas if r.replica_id in loads and loads[r.replica_id] < r.max_ongoing_requests]
        if not open_:
            return [candidate_replicas]  # all full or silent: Ray probes them again, with backoff
        call = call_of(pending_request)
        open_ = holding_adapter(open_, call.model if call is not None else None, self.adapters_of)
        prompts = PromptHashes(call.prompts) if call is not None and call.prompts else None
        candidates = [Candidate(r.replica_id.unique_id, load=loads[r.replica_id],
                                cached_tokens=self.cached_tokens(r, prompts)) for r in open_]
        name = self.policy.choose(candidates, call.session if call is not None else None)
        chosen = next(r for r in open_ if r.replica_id.unique_id == name)
        rest = sorted((r for r in open_ if r is not chosen), key=lambda r: loads[r.replica_id])
        return [[chosen], rest] if rest else [[chosen]]

    @staticmethod
    def adapters_of(replica: RunningReplica) -> list[str]:
        """The LoRA adapters the replica reported loaded."""
        return list(((replica.routing_stats or {}).get(STATS_KEY) or {}).get("lora_adapters") or [])

    def cached_tokens(self, replica: RunningReplica, prompts: PromptHashes | None) -> int:
        if prompts is None:
            return 0
        cache = self.cache_of(replica)
        return prompts.cached_tokens(cache.scheme, cache.cached)

    # -- replicas that go away ----------------------------------------------------------------
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = set(self._replica_id_set)
        super().update_replicas(replicas)
        for gone in before - set(self._replica_id_set):
            self._forget(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def _forget(self, replica_id: ReplicaID) -> None:
        self._caches.pop(replica_id, None)
        self.policy.forget(replica_id.unique_id)
