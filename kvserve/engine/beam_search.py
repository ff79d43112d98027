"""Beam search over a model's next-token log-probabilities, as vLLM does it (no torch here).

Each step, every live beam needs its ``2 x width`` most likely next tokens (the driver asks the
engine for them: ``kvserve.server.beam``); ``advance`` extends each beam by each of them, sets
aside the beams that end (EOS or a stop token id), and keeps the ``width`` best of the rest. After
``max_tokens`` steps, or once no beam is live, ``best`` ranks the ended and the live beams
together and returns the ``width`` best. Beams are ranked by vLLM's score: the cumulative
log-probability over ``length ** length_penalty``, the length counting the prompt and not a final
EOS (so ``length_penalty`` > 1 favours longer answers, < 1 shorter ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_BEAM_WIDTH = 10  # each step asks for 2 x width logprobs per beam, and a request takes at most 20


@dataclass(frozen=True)
class Beam:
    tokens: tuple[int, ...]  # the output so far (an ended beam's last token is its EOS or stop token)
    logprob: float = 0.0  # cumulative
    ended: bool = False


@dataclass
class BeamSearch:
    prompt_len: int
    width: int
    max_tokens: int
    stop_token_ids: frozenset[int]  # tokens that end a beam (EOS unless ignore_eos, and stop_token_ids)
    length_penalty: float = 1.0
    live: list[Beam] = field(default_factory=lambda: [Beam(())])
    ended: list[Beam] = field(default_factory=list)
    steps: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam width must be in [1, {MAX_BEAM_WIDTH}], got {self.width}")

    @property
    def candidates_per_beam(self) -> int:
        return 2 * self.width

    @property
    def done(self) -> bool:
        return not self.live or self.steps >= self.max_tokens

    def score(self, beam: Beam) -> float:
        length = self.prompt_len + len(beam.tokens) - (1 if beam.ended else 0)
        return beam.logprob / max(length, 1) ** self.length_penalty

    def advance(self, candidates: list[list[tuple[int, float]]]) -> None:
        """One step: ``candidates[i]`` holds (token, logprob) of live beam i's most likely next tokens."""
        if len(candidates) != len(self.live):
            raise ValueError(f"{len(candidates)} candidate lists for {len(self.live)} live beams")
        grown: list[Beam] = []
        for beam, options in zip(self.live, candidates):
            for token, logprob in options:
                new = Beam(beam.tokens + (token,), beam.logprob + logprob, token in self.stop_token_ids)
                (self.ended if new.ended else grown).append(new)
        grown.sort(key=self.score, reverse=True)  # stable: among equal scores, earlier beams first
        self.live = grown[: self.width]
        self.steps += 1

    def best(self) -> list[Beam]:
        """The ``width`` best beams, ended and live alike, best first."""
        return sorted(self.ended + self.live, key=self.score, reverse=True)[: self.width]
