"""Structured output (constrained decoding): JSON schema, JSON object, regex, choice, EBNF and Lark.

The grammar engine is xgrammar (docs/results/grammar-engines.md says why); Lark grammars, which
xgrammar does not read, go to llguidance (``lark``) behind the same matcher interface. Flow for a request:
``GuidedSpec`` -> ``GrammarCache.get_or_compile`` / ``submit`` (compiled once, LRU-bounded) ->
a ``GrammarMatcher`` per request -> each step ``fill_masks`` + ``apply_masks`` before sampling,
``GrammarMatcher.accept`` after it (the runner does both through ``masking``).
"""

from kvserve.structured.compiler import (
    CacheStats,
    CompiledGrammar,
    GrammarCache,
    TokenizerInfo,
    build_tokenizer_info,
    engine_reason,
)
from kvserve.structured.matcher import (
    GrammarMatcher,
    allocate_bitmask,
    apply_masks,
    bitmask_width,
    fill_masks,
    new_matcher,
)
from kvserve.structured.spec import KINDS, GuidedSpec, choice_to_ebnf

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
