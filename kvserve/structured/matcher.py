"""A request's grammar state (``GrammarMatcher``) and the batched token-mask helpers.

One decode step for a batch: ``fill_masks`` writes each constrained request's allowed tokens into
an int32 bitmask (bit ``j % 32`` of word ``j // 32`` set = token ``j`` allowed) and returns the
rows it filled; ``apply_masks`` sets the disallowed logits of those rows to -inf in place; after
sampling, each matcher ``accept``s its token.

End of output: once the grammar is complete, the stop tokens (the tokenizer info's, or the
matcher's ``stop_token_ids``) become allowed; when nothing else can follow they are the only
allowed tokens. Accepting one terminates the matcher (``is_terminated``); ``rollback`` undoes it.

Speculative decoding: ``validate_tokens`` counts how many drafted tokens the grammar allows
without changing the state; ``accept`` them and ``rollback(n)`` the rejected tail (xgrammar
keeps unlimited history).

Torch is used only for the bitmask tensor and ``apply_masks``. Masks are filled on CPU; the logits
may live on any device (the bitmask is copied to it).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

from kvserve.structured.utf8_guard import SurrogateGuard


def bitmask_width(vocab_size: int) -> int:
    """Int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask [batch_size, ceil(vocab_size / 32)] allowing every token."""
    return torch.full((batch_size, bitmask_width(vocab_size)), -1, dtype=torch.int32)


class GrammarMatcher:
    """The grammar state of one request: which tokens may come next, and what was accepted.

    Not thread-safe: drive one matcher from one thread at a time.
    """

    def __init__(self, compiled: xgr.CompiledGrammar, *, stop_token_ids: Sequence[int] | None = None,
                 utf8_guard: SurrogateGuard | None = None):
        """``stop_token_ids`` (e.g. the model's EOS ids plus the request's stop tokens) replace the
        tokenizer info's; None or empty keeps them. ``utf8_guard`` (the vocabulary's, built once)
        keeps UTF-8-encoded surrogates out, which xgrammar lets through."""
        stops = list(stop_token_ids) if stop_token_ids else None
        self._m = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        # xgrammar refuses a special token even when it is a stop token, with a warning each time
        # (the request's own stop_token_ids may name one); such a token ends the request anyway
        self._special_stops = frozenset(stops or ()) & frozenset(compiled.tokenizer_info.special_token_ids)
        self.vocab_size: int = compiled.tokenizer_info.vocab_size
        self.num_accepted = 0  # tokens accepted and not rolled back (the stop token included)
        self._guard = utf8_guard
        self._lead: list[bool] = []  # per accepted token, with a guard: does the output end in a lone ED byte

    @property
    def stop_token_ids(self) -> list[int]:
        return self._m.stop_token_ids

    def fill_mask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (CPU int32, width ``bitmask_width``)."""
        if self._m.is_terminated():
            raise RuntimeError("the grammar matcher has terminated: no token may follow the stop token")
        self._m.fill_next_token_bitmask(bitmask, row)
        if self._guard is not None and self._pending_lead:
            self._guard.mask(bitmask, row)

    @property
    def _pending_lead(self) -> bool:
        """Whether the output so far ends in a lone ED byte (only tracked with a guard)."""
        return bool(self._lead) and self._lead[-1]

    def _lead_after(self, pending: bool, token_id: int) -> bool | None:
        """The guard's state after ``token_id`` (None: it would make a surrogate); without a guard, False."""
        return False if self._guard is None else self._guard.after(pending, token_id)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it."""
        if token_id in self._special_stops:
            return False
        lead = self._lead_after(self._pending_lead, token_id)
        if lead is None:
            return False
        ok = self._m.accept_token(int(token_id))
        if ok:
            self.num_accepted += 1
            self._lead.append(lead)
        return ok

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (a stop token included)."""
        if n < 0 or n > self.num_accepted:
            raise ValueError(f"cannot roll back {n} tokens: {self.num_accepted} accepted")
        if n:
            self._m.rollback(n)
            self.num_accepted -= n
            del self._lead[len(self._lead) - n:]

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar allows in a row; the state is left unchanged."""
        n = 0
        pending = self._pending_lead
        for token in tokens:
            lead = self._lead_after(pending, token)
            if lead is None or token in self._special_stops or not self._m.accept_token(int(token)):
                break
            pending = lead
            n += 1
        if n:
            self._m.rollback(n)
        return n

    def is_terminated(self) -> bool:
        """True once a stop token was accepted."""
        return self._m.is_terminated()

    def is_completed(self) -> bool:
        """True when the output so far is a complete match (a stop token may come next)."""
        return self._m.is_completed()

    def reset(self) -> None:
        self._m.reset()
        self.num_accepted = 0
        self._lead.clear()


def new_matcher(compiled: Any, *, stop_token_ids: Sequence[int] | None = None,
                utf8_guard: SurrogateGuard | None = None) -> GrammarMatcher:
    """A request's matcher for what ``GrammarCache`` compiled: xgrammar's (with ``utf8_guard``, see
    ``GrammarCache.utf8_guard``), or llguidance's for Lark."""
    from kvserve.structured.lark import CompiledLark, LarkMatcher

    if isinstance(compiled, CompiledLark):
        return LarkMatcher(compiled, stop_token_ids=stop_token_ids)  # type: ignore[return-value]  # same interface
    return GrammarMatcher(compiled, stop_token_ids=stop_token_ids, utf8_guard=utf8_guard)


def fill_masks(matchers: Sequence[GrammarMatcher | None],
               out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, list[int]]:
    """Fill the token masks of one batch; ``matchers[i]`` is row i's (None: unconstrained).

    Returns ``(bitmask, rows)``: the rows of constrained, unterminated requests, and a bitmask
    with those rows filled (the others allow everything), or ``(None, [])`` when no row is
    constrained. ``out`` is reused when given (CPU int32, at least ``len(matchers)`` rows, the
    matchers' ``bitmask_width`` columns). One matcher after another: on this project's
    2-core machine that beat xgrammar's threaded batch fill by ~7x for 16 requests.
    """
    rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
    if not rows:
        return None, []
    vocab = matchers[rows[0]].vocab_size  # type: ignore[union-attr]
    if out is None:
        out = allocate_bitmask(len(matchers), vocab)
    else:
        out.fill_(-1)
    for i in rows:
        matchers[i].fill_mask(out, i)  # type: ignore[union-attr]
    return out, rows


# Row v of the table: for each bit b of a byte of value v, +inf if set, -inf if clear. Gathering
# it by the bitmask's bytes gives a cap per token; min(logit, cap) masks in two vectorised ops.
# For [16, 49152] float32 here: ~2.6x faster than xgrammar's CPU kernel, ~5x faster than
# unpacking the bits and masked_fill_.
assert sys.byteorder == "little", "the bitmask's bytes are read in little-endian order"
_CAPS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _caps(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    table = _CAPS.get((device, dtype))
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = torch.where(bits.bool(), float("inf"), float("-inf")).to(device=device, dtype=dtype)
        _CAPS[(device, dtype)] = table
    return table


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None) -> None:
    """Set disallowed logits to -inf, in place, in ``rows`` only (None: every row).

    ``bitmask[i]`` applies to ``logits[i]``. ``logits`` may be wider than the bitmask covers
    (a padded vocabulary): the uncovered ids are disallowed. Other rows are left untouched.
    """
    if rows is not None and len(rows) == 0:
        return
    bits = bitmask.to(logits.device, non_blocking=True)
    if rows is not None:
        idx = torch.as_tensor(list(rows), dtype=torch.long).to(logits.device)
        bits = bits.index_select(0, idx)
    else:
        bits = bits[: logits.shape[0]]
    n = bits.shape[0]
    byte_idx = bits.contiguous().view(torch.uint8).reshape(-1).long()  # little-endian: token order
    cap = _caps(logits.device, logits.dtype).index_select(0, byte_idx).view(n, -1)
    target = logits if rows is None else logits.index_select(0, idx)
    _cap_rows(target, cap)
    if rows is not None:
        logits.index_copy_(0, idx, target)


def _cap_rows(logits: torch.Tensor, cap: torch.Tensor) -> None:
    vocab = logits.shape[-1]
    if cap.shape[1] == vocab and logits.is_contiguous():
        torch.minimum(logits, cap, out=logits)
        return
    width = min(vocab, cap.shape[1])
    logits[:, :width] = torch.minimum(logits[:, :width], cap[:, :width])
    logits[:, width:] = float("-inf")
