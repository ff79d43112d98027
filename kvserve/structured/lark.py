"""Lark grammars (vLLM's ``grammar`` written in Lark syntax), through llguidance.

xgrammar reads EBNF/GBNF; llguidance reads Lark (and is the grammar engine of vLLM's ``guidance``
backend). A Lark spec compiles to a ``CompiledLark`` (the grammar checked against the tokenizer;
llguidance builds its lexer lazily, so checking is cheap) and each request gets a ``LarkMatcher``,
which behaves as ``kvserve.structured.matcher.GrammarMatcher`` does: the same bitmask layout, the
same stop-token rules (the request's stop tokens are allowed once the grammar is complete, and
accepting one terminates), ``accept`` that leaves the state unchanged on a refused token, and
``rollback`` for speculative decoding. llguidance is imported only once a Lark grammar is used.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

_TOKENIZERS: dict[int, Any] = {}  # id(HF tokenizer) -> llguidance tokenizer (a few hundred ms to build)
_TOKENIZERS_LOCK = threading.Lock()


def looks_like_lark(grammar: str) -> bool:
    """EBNF/GBNF defines rules with ``::=``; Lark with ``:`` (vLLM tells them apart the same way)."""
    return "::=" not in grammar


@dataclass(frozen=True)
class CompiledLark:
    grammar: str  # llguidance's form of the Lark text
    tokenizer: Any  # llguidance.LLTokenizer
    vocab_size: int

    @property
    def memory_size_bytes(self) -> int:
        return len(self.grammar)


def lark_tokenizer(hf_tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of a Hugging Face tokenizer, built once per tokenizer."""
    import llguidance.hf

    with _TOKENIZERS_LOCK:
        built = _TOKENIZERS.get(id(hf_tokenizer))
        if built is None:
            built = _TOKENIZERS[id(hf_tokenizer)] = (hf_tokenizer, llguidance.hf.from_tokenizer(
                hf_tokenizer, n_vocab=vocab_size))
        return built[1]


def compile_lark(text: str, hf_tokenizer: Any, vocab_size: int) -> CompiledLark:
    """Check a Lark grammar; ValueError with llguidance's first line of complaint if it is invalid."""
    import llguidance

    tokenizer = lark_tokenizer(hf_tokenizer, vocab_size)
    grammar = llguidance.LLMatcher.grammar_from_lark(text)
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise ValueError(error.strip().splitlines()[0])
    return CompiledLark(grammar, tokenizer, vocab_size)


def _bit(token_id: int) -> int:
    """Token ``token_id``'s bit in its int32 bitmask word, as a signed 32-bit value."""
    bit = 1 << (token_id % 32)
    return bit - (1 << 32) if bit >= 1 << 31 else bit


class LarkMatcher:
    """One request's state in a Lark grammar (the interface of ``GrammarMatcher``)."""

    def __init__(self, compiled: CompiledLark, *, stop_token_ids: Sequence[int] | None = None):
        import llguidance

        self._m = llguidance.LLMatcher(compiled.tokenizer, compiled.grammar, log_level=0)
        if self._m.is_error():
            raise ValueError(self._m.get_error())
        eos = compiled.tokenizer.eos_token
        self._stops = list(dict.fromkeys(stop_token_ids)) if stop_token_ids else [eos]
        self._stop_set = frozenset(self._stops)
        self._eos = eos
        self.vocab_size = compiled.vocab_size
        self.num_accepted = 0
        self._terminated = False

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self._stops)

    def fill_mask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        if self._terminated:
            raise RuntimeError("the grammar matcher has terminated: no token may follow the stop token")
        words = bitmask[row]
        if bitmask.dtype != torch.int32 or not words.is_contiguous() or words.device.type != "cpu":
            raise ValueError("the bitmask must be a contiguous CPU int32 tensor")
        # llguidance.torch's helper does just this, but importing it scripts a kernel (warnings)
        self._m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        if self._eos not in self._stop_set:  # llguidance allows its EOS when complete; ours are the stops
            words[self._eos // 32] &= ~_bit(self._eos)
        if self._m.is_accepting():
            for t in self._stops:
                words[t // 32] |= _bit(t)

    def accept(self, token_id: int) -> bool:
        if self._terminated:
            return False
        token_id = int(token_id)
        if token_id in self._stop_set and self._m.is_accepting():
            self._terminated = True
        elif token_id == self._eos or self._m.validate_tokens([token_id]) != 1:
            return False  # refused: consuming it would leave llguidance in its error state for good
        else:
            self._m.consume_token(token_id)
        self.num_accepted += 1
        return True

    def rollback(self, n: int) -> None:
        if n < 0 or n > self.num_accepted:
            raise ValueError(f"cannot roll back {n} tokens: {self.num_accepted} accepted")
        undo = n
        if undo and self._terminated:
            self._terminated, undo = False, undo - 1
        if undo:
            self._m.rollback(undo)
        self.num_accepted -= n

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        n = 0
        for token in tokens:
            if not self.accept(token):
                break
            n += 1
        self.rollback(n)
        return n

    def is_terminated(self) -> bool:
        return self._terminated

    def is_completed(self) -> bool:
        return not self._terminated and self._m.is_accepting()

    def reset(self) -> None:
        self._m.reset()
        self.num_accepted = 0
        self._terminated = False
