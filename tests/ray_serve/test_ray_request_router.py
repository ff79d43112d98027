"""The Ray Serve request router picks replicas by kvserve's policy, from fake replica states (no cluster).

Each fake replica reports its prefix cache as a real replica does (``cache_stats`` over a
``KVEventLog`` holding a prompt's chain hashes) and answers Ray's queue-length probe; the router
must send the prompt to the replica holding its longest cached prefix, within the load bound.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'ray[serve]')")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from kvserve.ray_serve.call import ReplicaCall  # noqa: E402
from kvserve.ray_serve.replica import cache_stats  # noqa: E402
from kvserve.ray_serve.request_router import CacheAwareRequestRouter, ReplicaCache  # noqa: E402
from kvserve.router.prefix import HashScheme, block_hashes  # noqa: E402
from kvserve.server.kv_events import KVEventLog  # noqa: E402

DEPLOYMENT = DeploymentID(name="KVServeReplica", app_name="kvserve")
BLOCK = 16
ROOT = b"\x01" * 16
PROMPT = list(range(100, 100 + 4 * BLOCK + 1))  # four full blocks (the last token is never matched)


class FakeReplica:
    """What the router reads of a running replica: its id, routing stats, queue length, capacity."""

    def __init__(self, name: str, cached_blocks: int = 0, queue_len: int = 0, max_ongoing: int = 64,
                 adapters: list[str] | None = None):
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.queue_len = queue_len
        self.max_ongoing_requests = max_ongoing
        log = KVEventLog(BLOCK, ROOT)
        log.apply(block_hashes(PROMPT, HashScheme(ROOT, BLOCK))[:cached_blocks], [])
        client = SimpleNamespace(kv_events=log, lora_adapters=adapters)
        self.routing_stats = {"kvserve": cache_stats(client)}  # what the real replica reports

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


def make_router(**kwargs) -> CacheAwareRequestRouter:
    router = CacheAwareRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**kwargs)
    return router


LOOP = asyncio.new_event_loop()  # one loop for every router here: a router keeps the loop it first ran on


def choose(router, replicas, prompts=(PROMPT,), session=None, model=None) -> list[list[str]]:
    """The router's ranking of ``replicas`` for a request with ``prompts``, by name."""
    async def go():
        call = ReplicaCall("POST", "/v1/completions", "", [], b"{}", prompts=[list(p) for p in prompts] or None,
                           session=session, model=model)
        pending = PendingRequest(args=[call], kwargs={}, metadata=RequestMetadata("r", "r"))
        ranks = await router.choose_replicas(replicas, pending)
        return [[r.replica_id.unique_id for r in rank] for rank in ranks]
    return LOOP.run_until_complete(go())


def test_the_replica_holding_the_longest_cached_prefix_is_chosen_first():
    replicas = [FakeReplica("a", cached_blocks=1), FakeReplica("b", cached_blocks=3), FakeReplica("c")]
    assert choose(make_router(), replicas)[0] == ["b"]
    # the others stay as a fallback rank, least loaded first
    replicas[0].queue_len, replicas[2].queue_len = 2, 1
    assert choose(make_router(), replicas) == [["b"], ["c", "a"]]


def test_a_replica_past_the_load_bound_loses_its_cache_advantage():
    replicas = [FakeReplica("a", cached_blocks=1, queue_len=3), FakeReplica("b", cached_blocks=3, queue_len=12)]
    assert choose(make_router(max_load_imbalance=8), replicas)[0] == ["a"]  # 12 - 3 > 8
    assert choose(make_router(max_load_imbalance=9), replicas)[0] == ["b"]  # 12 - 3 <= 9


def test_full_replicas_are_skipped_and_nothing_cached_is_least_load():
    replicas = [FakeReplica("a", cached_blocks=4, queue_len=2, max_ongoing=2), FakeReplica("b", queue_len=1),
                FakeReplica("c", queue_len=0)]
    assert choose(make_router(), replicas)[0] == ["c"]  # a is full; b and c hold nothing of the prompt
    assert choose(make_router(), replicas, prompts=())[0] == ["c"]  # a request with no prompt: least load


def test_equal_replicas_take_turns_and_sessions_stick():
    replicas = [FakeReplica("a", cached_blocks=2), FakeReplica("b", cached_blocks=2)]
    router = make_router()
    firsts = [choose(router, replicas)[0][0] for _ in range(4)]
    assert firsts == ["a", "b", "a", "b"]  # the tie goes to the one picked least recently
    router = make_router(policy="session")
    first = choose(router, replicas, session="alice")[0][0]
    assert all(choose(router, replicas, session="alice")[0][0] == first for _ in range(3))


def test_routing_stats_round_trip_and_bad_stats_read_as_an_empty_cache():
    stats = FakeReplica("a", cached_blocks=2).routing_stats
    cache = ReplicaCache.from_stats(stats)
    assert cache.scheme == HashScheme(ROOT, BLOCK)
    assert cache.cached == set(block_hashes(PROMPT, HashScheme(ROOT, BLOCK))[:2])
    for bad in (None, {}, {"kvserve": "x"}, {"kvserve": {"cached": b"123"}}):
        assert ReplicaCache.from_stats(bad).cached == frozenset()


def test_an_adapters_requests_go_to_a_replica_that_has_it_loaded():
    replicas = [FakeReplica("a", cached_blocks=4), FakeReplica("b", adapters=["sql"])]
    router = make_router()
    assert choose(router, replicas, model="sql")[0] == ["b"]  # over a's cached prefix
    assert choose(router, replicas, model="base")[0] == ["a"]
    assert choose(router, replicas, model="nobody-has-it")[0] == ["a"]
