"""Compiling ``GuidedSpec``s with xgrammar, behind a bounded, thread-safe LRU cache.

xgrammar was chosen over llguidance on this project's measurements (docs/results/grammar-engines.md):
its per-step token masks are ~3x cheaper; it compiles ahead instead (a realistic schema takes
~20 ms here), which ``GrammarCache.submit`` keeps off the engine's thread (xgrammar releases the
GIL while compiling).

``build_tokenizer_info`` builds the tokenizer description once per model: it takes the model's
logits width (which may exceed the tokenizer's size; extra ids are never allowed) and blanks the
tokenizer's special tokens, which xgrammar would otherwise treat as literal text (so that, say,
``<|im_start|>`` could be sampled inside a JSON string).
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from kvserve.errors import InvalidArgumentError
from kvserve.structured.lark import CompiledLark, compile_lark, looks_like_lark
from kvserve.structured.spec import GuidedSpec, choice_to_ebnf
from kvserve.structured.utf8_guard import SurrogateGuard
from kvserve.structured.worker import (
    CompileCrashed,
    CompileTimeout,
    CompileWorker,
    InvalidGrammar,
    compile_grammar,
    error_text,
)

CompiledGrammar = xgr.CompiledGrammar
TokenizerInfo = xgr.TokenizerInfo


def build_tokenizer_info(tokenizer: Any, vocab_size: int | None = None,
                         stop_token_ids: Sequence[int] | None = None) -> xgr.TokenizerInfo:
    """Describe a Hugging Face fast tokenizer to xgrammar (a few hundred ms: build it once).

    ``vocab_size`` is the model's logits width (``ModelConfig.vocab_size``); ids at or above the
    tokenizer's size are never allowed. ``stop_token_ids`` (default: the tokenizer's EOS) become
    allowed once the grammar is complete, and are the only ones allowed when nothing else can
    follow; a matcher can override them. Other special tokens are never allowed.
    """
    stops = list(stop_token_ids) if stop_token_ids else None
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
    size = detected.vocab_size
    encoded = [""] * size
    for text, idx in tokenizer.get_vocab().items():
        if idx < size:
            encoded[idx] = text
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    for idx, added in decoder.items():
        if getattr(added, "special", False) and idx < size:
            encoded[idx] = ""  # xgrammar treats empty tokens as special: never part of the text
    return xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=size,
                             stop_token_ids=detected.stop_token_ids, add_prefix_space=detected.add_prefix_space)


@dataclass(frozen=True)
class CacheStats:
    size: int
    max_size: int
    compiles: int
    hits: int
    evictions: int
    errors: int
    compile_seconds_total: float
    bytes: int  # memory of the cached compiled grammars, as xgrammar reports it


class GrammarCache:
    """Compiles specs once and keeps the ``max_size`` most recently used compiled grammars.

    Thread-safe. Concurrent requests for one uncompiled spec compile it once (the others wait
    and count as hits). Compile errors are not cached: they raise ``InvalidArgumentError`` each
    time. ``submit`` compiles on a small pool of worker threads and returns a Future. With
    ``compile_timeout_s``, xgrammar runs in a child process (``CompileWorker``) and a compile that
    outlasts the limit is refused; such specs are then refused at once.

    ``any_whitespace=False`` (default) makes JSON follow Python's ``json.dumps`` layout
    (``{"a": 1, "b": [2, 3]}``); True allows any whitespace between tokens, which small models
    can use to loop on newlines.
    """

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, max_size: int = 128, *, any_whitespace: bool = False,
                 compile_threads: int | None = None, workers: int = 1, compile_timeout_s: float | None = None):
        if max_size < 1:
            raise ValueError("max_size must be >= 1")
        self.tokenizer_info = tokenizer_info
        self.hf_tokenizer: Any = None  # set by from_tokenizer; Lark grammars need it
        self.max_size = max_size
        self.any_whitespace = any_whitespace
        threads = compile_threads or min(8, os.cpu_count() or 1)
        # With a time limit, compiles run in a child process that is killed past it; without, here.
        # xgrammar's own cache is unbounded by default; this class is the cache.
        self._worker = CompileWorker(tokenizer_info, compile_timeout_s, threads) if compile_timeout_s else None
        self._compiler = None if self._worker else xgr.GrammarCompiler(tokenizer_info, max_threads=threads,
                                                                       cache_enabled=False)
        self._refused: OrderedDict[str, str] = OrderedDict()  # cache key -> why (timeouts and crashes)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._inflight: dict[str, Future[xgr.CompiledGrammar]] = {}
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvserve-grammar")
        self.compiles = 0
        self.hits = 0
        self.evictions = 0
        self.errors = 0
        self.compile_seconds_total = 0.0
        self._bytes = 0

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int | None = None,
                       stop_token_ids: Sequence[int] | None = None, **kwargs: Any) -> GrammarCache:
        cache = cls(build_tokenizer_info(tokenizer, vocab_size, stop_token_ids), **kwargs)
        cache.hf_tokenizer = tokenizer  # Lark grammars build llguidance's tokenizer from it
        return cache

    @functools.cached_property
    def utf8_guard(self) -> SurrogateGuard:
        """The vocabulary's ``SurrogateGuard`` for matchers (built on first use, ~0.1 s)."""
        return SurrogateGuard.from_tokenizer_info(self.tokenizer_info)

    @property
    def vocab_size(self) -> int:
        """The token mask's width in tokens (the model's logits width given at setup)."""
        return self.tokenizer_info.vocab_size

    def __len__(self) -> int:
        return len(self._cache)

    def __contains__(self, spec: GuidedSpec) -> bool:
        return spec.cache_key in self._cache

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(len(self._cache), self.max_size, self.compiles, self.hits, self.evictions,
                              self.errors, self.compile_seconds_total, self._bytes)

    def _hit(self, key: str) -> xgr.CompiledGrammar | Future | None:
        """Under the lock: the cached grammar (now most recently used) or the compile already in flight,
        either counted as a hit; None on a miss."""
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return compiled
        waiting = self._inflight.get(key)
        if waiting is not None:
            self.hits += 1
        return waiting

    def get_or_compile(self, spec: GuidedSpec) -> xgr.CompiledGrammar:
        """The compiled grammar for ``spec``, compiling it on this thread if needed."""
        key = spec.cache_key
        with self._lock:
            hit = self._hit(key)
            if hit is None:
                mine: Future[xgr.CompiledGrammar] = Future()
                self._inflight[key] = mine
        if hit is not None:
            return hit.result() if isinstance(hit, Future) else hit
        try:
            compiled = self._compile_timed(spec)
        except BaseException as e:
            with self._lock:
                del self._inflight[key]
            mine.set_exception(e)
            raise
        with self._lock:
            del self._inflight[key]
            self._cache[key] = compiled
            self._bytes += compiled.memory_size_bytes
            while len(self._cache) > self.max_size:
                _, old = self._cache.popitem(last=False)
                self._bytes -= old.memory_size_bytes
                self.evictions += 1
        mine.set_result(compiled)
        return compiled

    def submit(self, spec: GuidedSpec) -> Future[xgr.CompiledGrammar]:
        """Compile off the caller's thread; a cached spec gives an already finished Future."""
        with self._lock:
            hit = self._hit(spec.cache_key)
        if isinstance(hit, Future):
            return hit
        if hit is not None:
            done: Future[xgr.CompiledGrammar] = Future()
            done.set_result(hit)
            return done
        return self._pool.submit(self.get_or_compile, spec)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._worker is not None:
            self._worker.close()

    def _compile_timed(self, spec: GuidedSpec) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        try:
            compiled = self.compile(spec)
        finally:
            with self._lock:
                self.compile_seconds_total += time.perf_counter() - start
        with self._lock:
            self.compiles += 1
        return compiled

    def compile(self, spec: GuidedSpec) -> xgr.CompiledGrammar:
        """Compile without the cache; an invalid spec, or one over the compile time limit, raises
        ``InvalidArgumentError``."""
        kind, text = _grammar_text(spec)
        what = _WHAT[spec.kind]
        if kind == "grammar" and looks_like_lark(text):
            return self._compile_lark(text, spec)
        try:
            if self._compiler is not None:
                return compile_grammar(self._compiler, kind, text, self.any_whitespace)
            assert self._worker is not None
            with self._lock:
                refused = self._refused.get(spec.cache_key)
            if refused is not None:
                raise CompileTimeout(refused)
            return self._worker.compile(kind, text, self.any_whitespace)
        except (CompileTimeout, CompileCrashed) as e:
            with self._lock:
                self.errors += 1
                # a spec that timed out would time out again: refuse it at once from now on
                self._refused[spec.cache_key] = str(e)
                while len(self._refused) > REFUSED_SPECS_KEPT:
                    self._refused.popitem(last=False)
            raise InvalidArgumentError(f"the {what} {e}; simplify it", param=spec.param) from None
        except (InvalidGrammar, RuntimeError, ValueError, TypeError) as e:
            with self._lock:
                self.errors += 1
            raise InvalidArgumentError(f"invalid {what}: {engine_reason(e)}", param=spec.param) from None


    def _compile_lark(self, text: str, spec: GuidedSpec) -> CompiledLark:
        if self.hf_tokenizer is None:
            raise InvalidArgumentError("Lark grammars need the cache built from a tokenizer; write the grammar "
                                       "in EBNF (root ::= ...)", param=spec.param)
        try:
            return compile_lark(text, self.hf_tokenizer, self.vocab_size)
        except ModuleNotFoundError:
            raise InvalidArgumentError("Lark grammars need llguidance (pip install llguidance); or write the "
                                       "grammar in EBNF (root ::= ...)", param=spec.param) from None
        except ValueError as e:
            with self._lock:
                self.errors += 1
            raise InvalidArgumentError(f"invalid Lark grammar: {e}", param=spec.param) from None


REFUSED_SPECS_KEPT = 1024  # specs remembered as too costly to compile
_WHAT = {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regular expression",
         "choice": "choice", "grammar": "grammar", "structural_tag": "tool schema"}


def _grammar_text(spec: GuidedSpec) -> tuple[str, str]:
    """What xgrammar compiles for ``spec``: ("json_schema" | "regex" | "grammar" | "structural_tag", text)."""
    if spec.kind == "json_object":
        return "json_schema", '{"type": "object"}'
    if spec.kind == "choice":
        return "grammar", choice_to_ebnf(json.loads(spec.canonical))
    return spec.kind, spec.canonical


_LOG_PREFIX = re.compile(r"^\s*\[[\d:. ]+\]\s*\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def engine_reason(error: BaseException) -> str:
    """xgrammar's message without its C++ log prefix (time, source file and line)."""
    text = error_text(error).strip()
    text = _CHECK_PREFIX.sub("", _LOG_PREFIX.sub("", text))
    return text.splitlines()[0].strip() if text else type(error).__name__
