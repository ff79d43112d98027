"""Per-request logit processing before a draw: logit_bias, allowed_token_ids, bad_words, min_tokens.

Each works as vLLM defines it, on one row of logits at a time:

* ``logit_bias``: the bias is added to those tokens' logits;
* ``allowed_token_ids``: every other token is set to -inf;
* ``bad_words``: each word as token sequences (``kvserve.text.tokenizer.bad_words_token_ids``),
  whose last token is set to -inf wherever the output so far ends with the rest of the sequence
  (a one-token word: always);
* ``min_tokens``: while the output is shorter, EOS (unless ``ignore_eos``) and the stop token
  ids are set to -inf.

The sampler and speculative verification apply it (after the penalties) to a copy of the
logits, so the logprobs a request gets still describe the model's own distribution, as vLLM's
default (raw) logprobs do. Requests without any of these never reach this module.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from kvserve.engine.request import Request

NEG_INF = float("-inf")


@dataclass
class _Prepared:
    """A request's processing as tensors, built on its first step and kept while it runs."""

    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    disallowed: torch.Tensor | None  # bool [vocab]: True where allowed_token_ids does not allow
    stop_ids: torch.Tensor | None  # what min_tokens holds back


class LogitProcessing:
    """Applies a request's logit processing to one row; keeps its tensors between steps."""

    def __init__(self) -> None:
        self._prepared: weakref.WeakKeyDictionary[Request, _Prepared] = weakref.WeakKeyDictionary()

    def _prepare(self, req: Request, row: torch.Tensor) -> _Prepared:
        prep = self._prepared.get(req)
        if prep is not None:
            return prep
        p, dev = req.params, row.device
        bias_ids = bias_values = disallowed = stop_ids = None
        if p.logit_bias:
            bias_ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=dev)
            bias_values = torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=dev)
        if p.allowed_token_ids:
            disallowed = torch.ones(row.shape[-1], dtype=torch.bool, device=dev)
            disallowed[torch.tensor(p.allowed_token_ids, dtype=torch.long, device=dev)] = False
        if p.min_tokens:
            stops = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                stops.update(req.eos_token_ids)
            if stops:
                stop_ids = torch.tensor(sorted(stops), dtype=torch.long, device=dev)
        prep = _Prepared(bias_ids, bias_values, disallowed, stop_ids)
        self._prepared[req] = prep
        return prep

    def apply(self, row: torch.Tensor, req: Request, token_ids: list[int] | None = None) -> None:
        """In place, on the logits ``row`` [vocab] of ``req``; ``token_ids`` (default: the request's)
        is the sequence the row continues (speculative verification passes the drafts too)."""
        p = req.params
        seq = req.token_ids if token_ids is None else token_ids
        prep = self._prepare(req, row)
        if prep.bias_ids is not None:
            row.index_add_(0, prep.bias_ids, prep.bias_values)
        if prep.disallowed is not None:
            row.masked_fill_(prep.disallowed, NEG_INF)
        if p.bad_words_token_ids:
            ban_bad_words(row, p.bad_words_token_ids, seq[req.num_prompt_tokens :])
        if prep.stop_ids is not None and len(seq) - req.num_prompt_tokens < p.min_tokens:
            row[prep.stop_ids] = NEG_INF


def ban_bad_words(row: torch.Tensor, bad_words: list[list[int]], output: list[int]) -> None:
    """Set to -inf the token that would complete one of ``bad_words`` after ``output``."""
    for word in bad_words:
        prefix = len(word) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or output[-prefix:] == word[:-1]:
            row[word[-1]] = NEG_INF
