"""Which backend gets a request: the routing policies, as pure functions of what the router knows.

A policy sees one ``Candidate`` per healthy backend (how many of this prompt's tokens its prefix
cache is predicted to hold, the prefill work queued there, and its load: requests in flight or
queued there) and the request's session, and names one. No I/O and no clock: the only state is the tie-break's memory of when each
backend was last picked, and (``session``) which backend each session went to.

- ``cache-aware``: among the backends whose load is within ``max_imbalance`` of the least loaded,
  the one where the prompt's prefill would end first: the fewest prompt tokens queued for prefill
  there plus the prompt's own tokens it does not hold (weighted by ``NEW_WORK_WEIGHT``). With nothing queued anywhere that is the
  longest cached prefix; equal ones go to the less loaded; nothing cached anywhere is least-load.
  A cached prefix wins over an idle backend only while the work queued ahead of it there is
  smaller than what the idle one would recompute, so a hot prefix spreads to the other replicas
  as soon as that pays; and a backend the cache favours cannot pile up requests without bound:
  past the threshold the others take the traffic.
- ``least-load``: the fewest requests in flight.
- ``round-robin``: each backend in turn.
- ``session``: a session (``X-Session-Id`` or the ``user`` field) stays on its backend while that
  is up; new sessions and requests without one go where ``cache-aware`` sends them.

Every tie is broken by picking the candidate picked least recently (never picked first), so no
backend starves behind another that merely sorts first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

T = TypeVar("T")

POLICIES = ("cache-aware", "round-robin", "least-load", "session")
DEFAULT_MAX_IMBALANCE = 8
DEFAULT_MAX_SESSIONS = 100_000
# A token a backend must compute for this prompt counts for more than a token of work queued ahead
# of it: computing it delays every later request there too, waiting does not. Between 1 and ~1.45
# for prompts of a long shared prefix and a short own part, the weight sends a follower of a
# prefix still being computed to where it is computed (it waits about as long there as it would
# compute elsewhere), and a request that shares only part of it to an idle backend.
NEW_WORK_WEIGHT = 1.25


@dataclass(frozen=True)
class Candidate:
    """What a policy knows of one healthy backend, for one request."""

    name: str
    cached_tokens: int = 0  # this prompt's tokens predicted to be in its prefix cache
    load: int = 0  # requests in flight or waiting there
    queued_tokens: int = 0  # prompt tokens of requests sent there, predicted to be computed before this one


def holding_adapter(items: Sequence[T], model: str | None, adapters: Callable[[T], Collection[str]]) -> list[T]:
    """The backends among ``items`` that have the LoRA adapter ``model`` loaded (``adapters``: a backend's, as it
    reported them), so its requests go where its weights are; all of them when none has it (the base model's
    name, an adapter nobody loaded: each backend answers for itself)."""
    holding = [b for b in items if model is not None and model in adapters(b)]
    return holding or list(items)


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Candidate], session: str | None = None) -> str:
        """The name of the chosen candidate (``candidates`` is not empty)."""
        ...

    def forget(self, name: str) -> None:
        """The backend ``name`` is gone for good."""
        ...


class TieBreak:
    """Among equals, the one picked least recently: every backend gets its turn."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._clock = 0

    def pick(self, names: Sequence[str]) -> str:
        best = min(names, key=lambda n: (self._last.get(n, -1), n))
        self._clock += 1
        self._last[best] = self._clock
        return best

    def forget(self, name: str) -> None:
        self._last.pop(name, None)


class RoundRobin:
    """Each backend in turn (the least recently picked, which is round robin over a changing set)."""

    name = "round-robin"

    def __init__(self) -> None:
        self.tie = TieBreak()

    def choose(self, candidates: Sequence[Candidate], session: str | None = None) -> str:
        return self.tie.pick([c.name for c in candidates])

    def forget(self, name: str) -> None:
        self.tie.forget(name)


class LeastLoad:
    """The fewest requests in flight; ties in turn."""

    name = "least-load"

    def __init__(self) -> None:
        self.tie = TieBreak()

    def choose(self, candidates: Sequence[Candidate], session: str | None = None) -> str:
        low = min(c.load for c in candidates)
        return self.tie.pick([c.name for c in candidates if c.load == low])

    def forget(self, name: str) -> None:
        self.tie.forget(name)


class CacheAware:
    """The earliest end of prefill (queued prefill tokens + the prompt's uncached tokens; with nothing
    queued, the longest cached prefix) among the backends that carry at most ``max_imbalance``
    requests beyond the least loaded one."""

    name = "cache-aware"

    def __init__(self, max_imbalance: int = DEFAULT_MAX_IMBALANCE):
        if max_imbalance < 0:
            raise ValueError("max_imbalance must be at least 0")
        self.max_imbalance = max_imbalance
        self.tie = TieBreak()

    def choose(self, candidates: Sequence[Candidate], session: str | None = None) -> str:
        low = min(c.load for c in candidates)
        eligible = [c for c in candidates if c.load - low <= self.max_imbalance]  # the least loaded always is
        best = min(self.cost(c) for c in eligible)
        tied = [c for c in eligible if self.cost(c) == best]
        least = min(c.load for c in tied)
        return self.tie.pick([c.name for c in tied if c.load == least])

    @staticmethod
    def cost(c: Candidate) -> float:
        """The prefill work before this prompt's first token there, less the prompt's length (the same
        everywhere): tokens queued there, plus the prompt's uncached tokens weighted by NEW_WORK_WEIGHT."""
        return c.queued_tokens - NEW_WORK_WEIGHT * c.cached_tokens

    def forget(self, name: str) -> None:
        self.tie.forget(name)


class SessionAffinity:
    """A session stays on its backend while that backend is a candidate; everything else goes where
    ``fallback`` sends it. Remembers the ``max_sessions`` most recent sessions."""

    name = "session"

    def __init__(self, fallback: Policy | None = None, max_sessions: int = DEFAULT_MAX_SESSIONS):
        self.fallback = fallback or CacheAware()
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, str] = OrderedDict()

    def choose(self, candidates: Sequence[Candidate], session: str | None = None) -> str:
        if session is None:
            return self.fallback.choose(candidates)
        name = self._sessions.get(session)
        if name is None or all(c.name != name for c in candidates):
            name = self.fallback.choose(candidates)
            self._sessions[session] = name
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(session)
        return name

    def forget(self, name: str) -> None:
        self.fallback.forget(name)
        for session in [s for s, n in self._sessions.items() if n == name]:
            del self._sessions[session]


def make_policy(name: str, max_imbalance: int = DEFAULT_MAX_IMBALANCE) -> Policy:
    """The policy called ``name`` (one of ``POLICIES``)."""
    if name == "cache-aware":
        return CacheAware(max_imbalance)
    if name == "round-robin":
        return RoundRobin()
    if name == "least-load":
        return LeastLoad()
    if name == "session":
        return SessionAffinity(CacheAware(max_imbalance))
    raise ValueError(f"unknown routing policy {name!r}; one of {', '.join(POLICIES)}")
