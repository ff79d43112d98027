"""What a proposer is: given a sequence and a length, draft tokens that the target will verify."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.engine.request import Request


@dataclass
class DraftRequest:
    request: Request
    token_ids: list[int]  # the sequence as it stands after this step's tokens
    k: int  # how many tokens to draft at most


@dataclass
class Draft:
    token_ids: list[int]
    # [len(token_ids), vocab]: the distribution each draft was sampled from; None: a point mass
    # (deterministic drafting: prompt lookup, or a greedy draft model)
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    method: str

    def propose(self, batch: list[DraftRequest]) -> dict[str, Draft]:
        """Drafts keyed by request id; a request may get fewer than k tokens, or none."""
        ...

    def release(self, request_id: str) -> None:
        """The request is gone: drop whatever the proposer keeps for it."""
        ...
