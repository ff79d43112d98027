"""Prompt-lookup drafting: continue the sequence the way it continued last time its tail appeared.

No second model: the last n tokens (n from ``max_n`` down to ``min_n``) are looked up in the
prompt and the output so far, and the tokens that followed their latest earlier occurrence
are the draft. It pays where answers quote or edit their input (code edits, RAG, summaries).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvserve.spec.proposer import Draft, DraftRequest


class NgramProposer:
    method = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4, max_lookback: int = 8192):
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= ngram min <= ngram max")
        self.min_n, self.max_n = min_n, max_n
        self.max_lookback = max_lookback  # bounds the search cost on very long contexts

    def propose(self, batch: list[DraftRequest]) -> dict[str, Draft]:
        out = {}
        for d in batch:
            tokens = self.lookup(d.token_ids, d.k)
            if tokens:
                out[d.request.request_id] = Draft(tokens)
        return out

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier match of the longest matching tail."""
        if k <= 0 or len(tokens) <= self.min_n:
            return []
        arr = np.asarray(tokens[-self.max_lookback :], dtype=np.int64)
        for n in range(min(self.max_n, len(arr) - 1), self.min_n - 1, -1):
            tail = arr[-n:]
            # windows starting at 0 .. len-n-1: each has at least one token after it
            hits = np.flatnonzero((sliding_window_view(arr[:-1], n) == tail).all(axis=1))
            if hits.size:
                i = int(hits[-1]) + n
                return arr[i : i + k].tolist()
        return []

    def release(self, request_id: str) -> None:
        """Nothing is kept per request."""
