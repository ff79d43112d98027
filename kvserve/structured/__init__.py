"""Structured output (constrained decoding): JSON schema, JSON object, regex, choice, EBNF and Lark.

The grammar engine is xgrammar (docs/results/grammar-engines.md says why); Lark grammars, which
xgrammar does not read, go to llguidance (``lark``) behind the same matcher interface. Flow for a request:
``GuidedSpec`` -> ``GrammarCache.get_or_compile`` / ``submit`` (compiled once, LRU-bounded) ->
a ``GrammarMatcher`` per request -> each step ``fill_masks`` + ``apply_masks`` before sampling,
``GrammarMatcher.accept`` after it (the runner does both through ``masking``).
"""

from importlib import import_module
from typing import Any

from kvserve.structured.spec import KINDS, GuidedSpec, choice_to_ebnf

# The grammar engine's side (compiler, matcher) imports xgrammar: it loads on first use, so that the
# server (which only reads specs) starts without it and a request needing it gets a clear error.
_LAZY = {name: "kvserve.structured.compiler" for name in (
    "CacheStats", "CompiledGrammar", "GrammarCache", "TokenizerInfo", "build_tokenizer_info", "engine_reason")}
_LAZY.update({name: "kvserve.structured.matcher" for name in (
    "GrammarMatcher", "allocate_bitmask", "apply_masks", "bitmask_width", "fill_masks", "new_matcher")})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(name)


__all__ = [
    "KINDS",
    "CacheStats",
    "CompiledGrammar",
    "GrammarCache",
    "GrammarMatcher",
    "GuidedSpec",
    "TokenizerInfo",
    "allocate_bitmask",
    "apply_masks",
    "bitmask_width",
    "build_tokenizer_info",
    "choice_to_ebnf",
    "engine_reason",
    "fill_masks",
    "new_matcher",
]
