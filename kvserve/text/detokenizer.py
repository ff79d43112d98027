"""Token ids -> text while they stream: ``IncrementalDetokenizer`` turns generated ids into text
deltas one token at a time, never splitting a UTF-8 character across deltas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.text.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Keeps a short window of ids: those of the last delta (decoded again only as context, so that
    decoders treating the first token specially, e.g. SentencePiece's leading space, see the token
    before) and those not emitted yet. Each step decodes that window only, so the cost per token
    does not grow with the output. While the window's text ends in U+FFFD, a
    character is still incomplete (its bytes are split across tokens) and nothing is emitted.

    Without ``prompt_ids`` the deltas concatenate to ``tokenizer.decode(output_ids)``. With them,
    the last prompt tokens serve as context, so the first delta carries the space a continuation
    gets in the full text.
    """

    # How many prompt tokens to keep as context: enough for any decoder's look-behind.
    PROMPT_CONTEXT = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ):
        self._backend = tokenizer.backend
        self._skip = skip_special_tokens
        context = list(prompt_ids[-self.PROMPT_CONTEXT :]) if prompt_ids else []
        # ids[:read] were emitted already (or are prompt context); ids[read:] are held back.
        self._ids: list[int] = context
        self._read_offset = len(context)
        self._prefix_text = self._decode(context) if context else ""
        self._parts: list[str] = []
        self._num_tokens = 0

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)

    def step(self, token_id: int) -> str:
        """Add one generated id; return the text it completes ("" while a character is incomplete)."""
        self._ids.append(int(token_id))
        self._num_tokens += 1
        window_text = self._decode(self._ids)
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""  # a skipped special token, or a character still split across tokens
        return self._emit(window_text)

    def flush(self) -> str:
        """At the end of a sequence: the held-back text, even if it ends in an incomplete character."""
        window_text = self._decode(self._ids)
        if len(window_text) <= len(self._prefix_text):
            return ""
        return self._emit(window_text)

    def _emit(self, window_text: str) -> str:
        delta = window_text[len(self._prefix_text) :]
        # The ids just emitted become the context of the next window; older ones are dropped.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._parts.append(delta)
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._parts)

    @property
    def num_tokens(self) -> int:
        """How many ids ``step`` has been given."""
        return self._num_tokens
