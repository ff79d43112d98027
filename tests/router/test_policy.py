"""The routing policies, on given cache and load states: no servers, no clocks."""

from __future__ import annotations

from collections import Counter

import pytest

from kvserve.router.policy import (
    CacheAware,
    Candidate,
    LeastLoad,
    RoundRobin,
    SessionAffinity,
    TieBreak,
    make_policy,
)


def c(name: str, cached: int = 0, load: int = 0) -> Candidate:
    return Candidate(name, cached, load)


def test_cache_aware_takes_the_longest_cached_prefix():
    p = CacheAware(max_imbalance=4)
    assert p.choose([c("a", 32, 1), c("b", 64, 3), c("c", 0, 0)]) == "b"
    assert p.choose([c("a", 96, 2), c("b", 64, 0)]) == "a"


def test_cache_aware_equal_prefixes_go_to_the_less_loaded():
    p = CacheAware(max_imbalance=4)
    assert p.choose([c("a", 64, 3), c("b", 64, 1), c("c", 16, 0)]) == "b"


def test_cache_aware_load_threshold():
    p = CacheAware(max_imbalance=4)
    # b holds the prompt but carries 4 more requests than the least loaded: still within the bound
    assert p.choose([c("a", 0, 0), c("b", 64, 4)]) == "b"
    # one more and it is past the bound: the least loaded takes it
    assert p.choose([c("a", 0, 0), c("b", 64, 5)]) == "a"
    # past the bound, the next best cache within it wins over the least loaded
    assert p.choose([c("a", 0, 0), c("b", 64, 9), c("c", 32, 3)]) == "c"
    # a threshold of 0 is least-load with the cache as the tie-break
    assert CacheAware(0).choose([c("a", 0, 1), c("b", 64, 2), c("c", 16, 1)]) == "c"


def test_cache_aware_nothing_cached_is_least_load():
    p = CacheAware()
    assert p.choose([c("a", 0, 3), c("b", 0, 1), c("c", 0, 2)]) == "b"


def test_cache_aware_a_hot_prefix_spills_over_instead_of_piling_up():
    """Every request shares one cached prefix on "a": a takes requests until it is max_imbalance
    ahead, then the others take turns, so no backend starves and none runs away."""
    p = CacheAware(max_imbalance=2)
    load = {"a": 0, "b": 0, "c": 0}
    for _ in range(30):
        name = p.choose([c(n, 64 if n == "a" else 0, load[n]) for n in load])
        load[name] += 1  # nothing finishes
    assert max(load.values()) - min(load.values()) <= 3
    assert load["a"] == max(load.values())


def test_ties_are_broken_in_turn_not_by_order():
    """Equal candidates take turns: the first in the list never gets them all (starvation guard)."""
    p = CacheAware()
    picks = Counter(p.choose([c("a"), c("b"), c("c")]) for _ in range(30))
    assert picks == {"a": 10, "b": 10, "c": 10}
    # a new backend is picked first among equals, then joins the rotation
    assert p.choose([c("a"), c("b"), c("c"), c("d")]) == "d"


def test_tie_break_prefers_the_least_recently_picked():
    t = TieBreak()
    assert t.pick(["b", "a"]) == "a"  # never picked: by name
    assert t.pick(["a", "b"]) == "b"
    assert t.pick(["a", "b"]) == "a"
    t.forget("a")
    assert t.pick(["a", "b"]) == "a"  # forgotten: as if new


def test_round_robin_cycles_over_a_changing_set():
    p = RoundRobin()
    assert [p.choose([c("a"), c("b"), c("c")]) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    assert [p.choose([c("a"), c("c")]) for _ in range(4)] == ["a", "c", "a", "c"]  # b is down
    # round robin ignores caches and load
    assert [p.choose([c("a", 64, 9), c("b")]) for _ in range(2)] == ["b", "a"]


def test_least_load_picks_the_fewest_in_flight():
    p = LeastLoad()
    assert p.choose([c("a", 64, 2), c("b", 0, 1), c("c", 0, 5)]) == "b"
    assert sorted(p.choose([c("a", 0, 1), c("b", 0, 1)]) for _ in range(2)) == ["a", "b"]


def test_session_sticks_to_its_backend_while_it_is_up():
    p = SessionAffinity(LeastLoad())
    first = p.choose([c("a", 0, 0), c("b", 0, 1)], "alice")
    assert first == "a"
    # the session stays even when a is now the busier one and b holds more cache
    assert p.choose([c("a", 0, 7), c("b", 96, 0)], "alice") == "a"
    # another session goes where the fallback sends it
    assert p.choose([c("a", 0, 7), c("b", 0, 0)], "bob") == "b"
    # a is down: alice moves to b, and stays there once a is back
    assert p.choose([c("b", 0, 3)], "alice") == "b"
    assert p.choose([c("a", 0, 0), c("b", 0, 3)], "alice") == "b"
    # no session: the fallback
    assert p.choose([c("a", 0, 0), c("b", 0, 3)], None) == "a"


def test_session_forgets_a_removed_backend_and_old_sessions():
    p = SessionAffinity(LeastLoad(), max_sessions=2)
    assert p.choose([c("a")], "s1") == "a"
    p.forget("a")
    assert p.choose([c("a", 0, 1), c("b", 0, 0)], "s1") == "b"  # reassigned, not kept on a
    p.choose([c("a", 0, 0), c("b", 0, 1)], "s2")
    p.choose([c("a", 0, 0), c("b", 0, 1)], "s3")  # s1 is the oldest of three: forgotten
    assert p.choose([c("a", 0, 0), c("b", 0, 1)], "s1") == "a"


def test_make_policy():
    assert [make_policy(n).name for n in ("cache-aware", "round-robin", "least-load", "session")] == \
        ["cache-aware", "round-robin", "least-load", "session"]
    assert isinstance(make_policy("session").fallback, CacheAware)  # type: ignore[attr-defined]
    with pytest.raises(ValueError):
        make_policy("random")
    with pytest.raises(ValueError):
        CacheAware(-1)


def test_cache_aware_weighs_queued_prefill_against_the_cache():
    """The earliest end of prefill: queued prefill tokens there plus the prompt's uncached tokens."""
    p = CacheAware(max_imbalance=8)
    # b holds 512 more tokens of the prompt (worth 1.25 x 512 = 640 queued) but has 700 queued: a
    assert p.choose([Candidate("a", 0, 1, queued_tokens=0), Candidate("b", 512, 1, queued_tokens=700)]) == "a"
    # with 600 queued, b's cache still wins
    assert p.choose([Candidate("a", 0, 1, queued_tokens=0), Candidate("b", 512, 1, queued_tokens=600)]) == "b"
    # equal cost: the less loaded
    assert p.choose([Candidate("a", 0, 2, queued_tokens=0), Candidate("b", 512, 1, queued_tokens=640)]) == "b"
    assert p.choose([Candidate("a", 0, 1, queued_tokens=0), Candidate("b", 512, 2, queued_tokens=640)]) == "a"


def test_cache_aware_a_cold_wave_with_one_new_prefix_is_shared_out():
    """Four requests with one shared 1,300-token prefix (and a 600-token part of their own) arrive
    before anything is cached: the router's own predictions (the blocks and prefill it sent to
    each backend) split them 2/2, the shared prefix computed once per backend, instead of all on
    the first backend (or on both for every request)."""
    from kvserve.router.backends import Backend
    from kvserve.router.prefix import HashScheme, PromptHashes

    scheme = HashScheme(b"k" * 16, 16)
    shared = list(range(1, 1301))
    backends = {n: Backend(n, scheme=scheme) for n in ("a", "b")}
    p = CacheAware(max_imbalance=8)
    placed, predictions = [], []
    for i in range(4):
        prompt = PromptHashes([shared + [5000 + 1000 * i + j for j in range(600)]])
        cands = [Candidate(b.url, prompt.cached_tokens(scheme, b.cache_view), b.in_flight, b.queued_tokens)
                 for b in backends.values()]
        name = p.choose(cands)
        b = backends[name]
        cached = next(c.cached_tokens for c in cands if c.name == name)
        b.in_flight += 1
        predictions.append((b, b.predict(prompt.hashes(scheme)[0], prompt.num_tokens - cached)))
        placed.append((name, cached))
    assert sorted(n for n, _ in placed) == ["a", "a", "b", "b"]
    # each backend's second request is predicted to find the shared prefix its first is computing
    assert sorted(c for _, c in placed) == [0, 0, 1296, 1296]
    # a follower of a prefix in flight goes where it is being computed
    follower = PromptHashes([shared + list(range(5000, 5600)) + [9]])  # request 0's prompt and more
    cands = [Candidate(b.url, follower.cached_tokens(scheme, b.cache_view), b.in_flight, b.queued_tokens)
             for b in backends.values()]
    assert max(cands, key=lambda c: c.cached_tokens).name == placed[0][0]
    assert p.choose(cands) == placed[0][0]
    # the predictions end with their requests: nothing left computing or queued
    for b, pred in predictions:
        b.prefilled(pred)
        assert pred.prefilled
        b.finished(pred)
        b.finished(pred)  # idempotent
    assert all(not b.computing and b.queued_tokens == 0 for b in backends.values())
