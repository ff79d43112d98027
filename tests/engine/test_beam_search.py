"""Beam search's algorithm on synthetic distributions: exhaustive where nothing is pruned, EOS set
aside and ranked without its token, length_penalty, and the bounds."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from kvserve.engine.beam_search import MAX_BEAM_WIDTH, Beam, BeamSearch

VOCAB = 3
EOS = 2


def table(seed: int):
    """A fixed next-token distribution for every sequence (a dict keyed by the sequence)."""
    rng = random.Random(seed)
    dists = {}

    def dist(seq: tuple[int, ...]) -> list[tuple[int, float]]:
        if seq not in dists:
            w = [rng.random() + 0.01 for _ in range(VOCAB)]
            dists[seq] = [(t, math.log(x / sum(w))) for t, x in enumerate(w)]
        return dists[seq]
    return dist


def run(search: BeamSearch, dist) -> list[Beam]:
    while not search.done:
        top = [sorted(dist(b.tokens), key=lambda c: -c[1])[: search.candidates_per_beam] for b in search.live]
        search.advance(top)
    return search.best()


def score(tokens, logprob, prompt_len, penalty, ended):
    return logprob / (prompt_len + len(tokens) - ended) ** penalty


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("penalty", [0.0, 1.0, 2.0])
def test_equals_exhaustive_search_when_nothing_is_pruned(seed, penalty):
    # width 9 >= every sequence up to length 2, so only the last step ranks: the result is the
    # 9 best of all sequences (ended ones included) by vLLM's score
    dist, prompt_len, steps = table(seed), 5, 3
    got = run(BeamSearch(prompt_len, 9, steps, frozenset({EOS}), penalty), dist)
    every = []
    for n in range(1, steps + 1):
        for seq in itertools.product(range(VOCAB), repeat=n):
            if EOS in seq[:-1] or (n < steps and seq[-1] != EOS):
                continue  # a sequence ends at its EOS; shorter ones only when they ended
            lp = sum(dict(dist(seq[:i]))[seq[i]] for i in range(n))
            every.append((score(seq, lp, prompt_len, penalty, seq[-1] == EOS), seq))
    every.sort(key=lambda x: -x[0])
    assert [b.tokens for b in got] == [s for _, s in every[:9]]
    assert [b.ended for b in got] == [s[-1] == EOS for _, s in every[:9]]


def test_width_one_without_eos_is_greedy():
    dist = table(7)
    got = run(BeamSearch(4, 1, 6, frozenset()), dist)
    seq: tuple[int, ...] = ()
    for _ in range(6):
        seq += (max(dist(seq), key=lambda c: c[1])[0],)
    assert [b.tokens for b in got] == [seq]


def test_pruning_keeps_the_best_partial_beams():
    # two beams; the best first token leads only to bad continuations
    def dist(seq):
        if seq == ():
            return [(0, math.log(0.6)), (1, math.log(0.4))]
        if seq[0] == 0:
            return [(0, math.log(0.1)), (1, math.log(0.1))]
        return [(0, math.log(0.9)), (1, math.log(0.1))]
    assert run(BeamSearch(1, 2, 2, frozenset()), dist)[0].tokens == (1, 0)  # 0.4 * 0.9 beats 0.6 * 0.1
    assert run(BeamSearch(1, 1, 2, frozenset()), dist)[0].tokens[0] == 0  # width 1 is greedy: it misses it


def test_ended_beams_are_set_aside_and_searching_stops_when_none_is_live():
    def dist(seq):
        return [(EOS, math.log(0.9)), (0, math.log(0.1))]
    search = BeamSearch(3, 1, 50, frozenset({EOS}))
    got = run(search, dist)
    assert got[0].tokens == (EOS,) and got[0].ended
    assert search.steps == 50  # the live beam (0, 0, ...) kept going: one ended beam is not the end
    search = BeamSearch(3, 1, 50, frozenset({0, EOS}))
    run(search, dist)
    assert search.steps == 1 and not search.live  # every candidate ended


def test_length_penalty_favours_longer_or_shorter_answers():
    def dist(seq):  # ending now costs as much as continuing once
        return [(EOS, math.log(0.5)), (0, math.log(0.5))]
    long = run(BeamSearch(1, 1, 4, frozenset({EOS}), length_penalty=3.0), dist)
    short = run(BeamSearch(1, 1, 4, frozenset({EOS}), length_penalty=0.0), dist)
    assert len(long[0].tokens) > len(short[0].tokens)


def test_bounds():
    with pytest.raises(ValueError):
        BeamSearch(1, 0, 4, frozenset())
    with pytest.raises(ValueError):
        BeamSearch(1, MAX_BEAM_WIDTH + 1, 4, frozenset())
    with pytest.raises(ValueError):
        BeamSearch(1, 2, 4, frozenset()).advance([[], []])  # one live beam at the start
