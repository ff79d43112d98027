"""``SurrogateGuard``: keeps UTF-8-encoded surrogates out of constrained output.

xgrammar (0.2.9) takes the bytes ED A0..BF xx, a UTF-16 surrogate (U+D800..DFFF) in UTF-8's
shape, for one character of a JSON string or a character class. They are not UTF-8: the text
decodes them to three U+FFFD, so a string the grammar counted as 8 characters comes out as 10
and the answer fails its own schema (``maxLength``). A byte-level vocabulary has a token for the
lone byte ED and tokens that begin with a continuation byte, so a model can spell one.

The guard forbids, right after output whose bytes end with the lead byte ED, every token whose
first byte is A0..BF (what would make the surrogate). The other first-continuation limits of
RFC 3629 (after E0, F0, F4) xgrammar enforces itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SURROGATE_LEAD = 0xED
SURROGATE_SECOND = range(0xA0, 0xC0)


class SurrogateGuard:
    """What a vocabulary needs to keep surrogates out: built once per tokenizer (~0.1 s)."""

    def __init__(self, token_bytes: Sequence[bytes], mask_width: int):
        n = len(token_bytes)
        self.ends_with_lead = [bool(b) and b[-1] == SURROGATE_LEAD for b in token_bytes]
        self.makes_surrogate = [bool(b) and b[0] in SURROGATE_SECOND for b in token_bytes]
        self.empty = [not b for b in token_bytes]
        # int32 words with the bits of those tokens cleared: ANDed into a row of the token bitmask
        allowed = torch.ones(mask_width * 32, dtype=torch.bool)
        allowed[:n] = ~torch.tensor(self.makes_surrogate, dtype=torch.bool)
        weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
        words = (allowed.view(-1, 32).long() * weights).sum(1)
        self.allowed_after_lead = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)

    @classmethod
    def from_tokenizer_info(cls, info: object) -> SurrogateGuard:
        """From an ``xgrammar.TokenizerInfo`` (its decoded vocabulary)."""
        vocab: list[bytes] = info.decoded_vocab  # type: ignore[attr-defined]
        return cls(vocab, (info.vocab_size + 31) // 32)  # type: ignore[attr-defined]

    def after(self, pending_lead: bool, token_id: int) -> bool | None:
        """Whether the output ends with a lone lead byte ED once ``token_id`` follows it
        (``pending_lead``: whether it did before; a token of no bytes, a special one, changes
        nothing), or None when the token would complete a surrogate's first two bytes."""
        if token_id >= len(self.ends_with_lead):
            return pending_lead
        if pending_lead and self.makes_surrogate[token_id]:
            return None
        return pending_lead if self.empty[token_id] else self.ends_with_lead[token_id]

    def mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Clear, in ``bitmask[row]``, the tokens that would make a surrogate after a lone ED."""
        width = min(bitmask.shape[1], self.allowed_after_lead.shape[0])
        bitmask[row, :width] &= self.allowed_after_lead[:width]
