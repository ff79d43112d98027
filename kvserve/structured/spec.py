r"""What a request asks its output to match: a ``GuidedSpec`` and its stable cache key.

Kinds (``GuidedSpec.kind``) and their ``value``:

* ``json_schema``: a JSON Schema, as a dict or as JSON text. Canonical text: compact
  ``json.dumps`` that keeps key order. Sorting keys would be wrong: the output lists an object's
  properties in the schema's order, so ``{"b", "a"}`` and ``{"a", "b"}`` are different grammars;
* ``json_object``: any JSON object; ``value`` is ignored;
* ``regex``: a regular expression the whole output must match (xgrammar's regex dialect, close to
  ECMAScript / Python ``re`` without lookaround, backreferences or ``\p{..}`` classes);
* ``choice``: a list of strings; the output is exactly one of them;
* ``grammar``: a GBNF-style EBNF grammar as xgrammar and llama.cpp accept it, with the start rule
  named ``root`` (``root ::= "yes" | "no"``); see
  https://github.com/ggml-org/llama.cpp/blob/master/grammars/README.md; or, when the text defines
  no rule with ``::=``, a Lark grammar (start rule ``start``), which llguidance reads
  (``kvserve.structured.lark``);
* ``structural_tag``: an xgrammar structural tag (``{"type": "structural_tag", "format": ...}``, see
  https://xgrammar.mlc.ai/docs/tutorials/structural_tag.html), as a dict; tool calls use it
  (``kvserve.server.tools``). Canonical text: compact ``json.dumps``, key order kept.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from kvserve.errors import InvalidArgumentError
from kvserve.text.tokenizer import check_unicode

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
# Nesting of a JSON schema document (objects and arrays); compile time grows fast with it (~70 ms at
# 128 levels, 25 s at 1,000 here) and real schemas stay far below. The compile time limit
# (GrammarCache's compile_timeout_s) catches what a size bound cannot.
MAX_SCHEMA_DEPTH = 128
MAX_CHOICES = 4096

# The request parameter named in errors, unless the caller gives one (vLLM's / OpenAI's names).
DEFAULT_PARAM = {
    "json_schema": "response_format",
    "json_object": "response_format",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
    "structural_tag": "tools",
}


class GuidedSpec:
    """An immutable structured-output request; equal specs have equal ``cache_key``s.

    ``param`` names the request field in error messages and takes no part in equality.
    Malformed values (schema text that is not JSON, a choice list that is empty or not strings)
    raise ``InvalidArgumentError`` here; what only the grammar engine can judge is raised when the
    spec is compiled (``GrammarCache``).
    """

    __slots__ = ("kind", "value", "param", "canonical", "cache_key")

    kind: str
    value: Any
    param: str
    canonical: str  # the text that is compiled and hashed
    cache_key: str  # sha256 hex of kind + canonical text

    def __init__(self, kind: str, value: Any = None, *, param: str | None = None):
        if kind not in KINDS:
            raise InvalidArgumentError(f"unknown structured output kind {kind!r}; expected one of {', '.join(KINDS)}",
                                       param=param)
        param = param or DEFAULT_PARAM[kind]
        canonical = _canonical(kind, value, param)
        check_unicode(canonical, f"the {kind.replace('_', ' ')}", param)  # it is hashed and compiled as UTF-8
        self._fill(kind, value, param, canonical)

    def _fill(self, kind: str, value: Any, param: str, canonical: str) -> None:
        digest = hashlib.sha256(f"{kind}\n{canonical}".encode()).hexdigest()
        for name, v in (("kind", kind), ("value", value), ("param", param), ("canonical", canonical),
                        ("cache_key", digest)):
            object.__setattr__(self, name, v)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("GuidedSpec is immutable")

    def __reduce__(self) -> tuple:
        # Pickled to the engine process as its canonical text, not its value: a deeply nested
        # schema would overflow pickle's recursion limit in the command queue's feeder thread,
        # which drops what it cannot pickle (the request would never be answered). Rebuilt there
        # without parsing it again: nothing may fail while the engine reads its commands.
        return (_rebuild, (self.kind, self.canonical, self.param))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GuidedSpec) and other.cache_key == self.cache_key

    def __hash__(self) -> int:
        return hash(self.cache_key)

    def __repr__(self) -> str:
        text = self.canonical if len(self.canonical) <= 60 else self.canonical[:57] + "..."
        return f"GuidedSpec({self.kind!r}, {text!r})"

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, **kw: Any) -> GuidedSpec:
        return cls("json_schema", schema, **kw)

    @classmethod
    def json_object(cls, **kw: Any) -> GuidedSpec:
        return cls("json_object", None, **kw)

    @classmethod
    def regex(cls, pattern: str, **kw: Any) -> GuidedSpec:
        return cls("regex", pattern, **kw)

    @classmethod
    def choice(cls, choices: Sequence[str], **kw: Any) -> GuidedSpec:
        return cls("choice", choices, **kw)

    @classmethod
    def grammar(cls, ebnf: str, **kw: Any) -> GuidedSpec:
        return cls("grammar", ebnf, **kw)


def _canonical(kind: str, value: Any, param: str) -> str:
    if kind == "json_object":
        return ""
    if kind == "json_schema":
        if isinstance(value, (str, bytes)):
            try:
                value = json.loads(value)
            except RecursionError:
                raise InvalidArgumentError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels",
                                           param=param) from None
            except ValueError as e:
                raise InvalidArgumentError(f"the JSON schema is not valid JSON: {e}", param=param) from None
        if not isinstance(value, (dict, bool)):
            raise InvalidArgumentError("the JSON schema must be a JSON object", param=param)
        if _depth(value) > MAX_SCHEMA_DEPTH:
            raise InvalidArgumentError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels", param=param)
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)  # key order kept: see above
    if kind == "structural_tag":
        if not isinstance(value, dict):
            raise InvalidArgumentError("the structural tag must be a JSON object", param=param)
        if _depth(value) > MAX_SCHEMA_DEPTH + 8:  # the tag's own nesting around its schemas
            raise InvalidArgumentError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels", param=param)
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    if kind == "choice":
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
            raise InvalidArgumentError("the choice must be a non-empty list of strings", param=param)
        if not all(isinstance(c, str) for c in value):
            raise InvalidArgumentError("every choice must be a string", param=param)
        if len(value) > MAX_CHOICES:
            raise InvalidArgumentError(f"at most {MAX_CHOICES} choices, got {len(value)}", param=param)
        # the language is a set: order and repeats do not change it
        return json.dumps(sorted(set(value)), ensure_ascii=False)
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"the {kind} must be a non-empty string", param=param)
    return value


def _depth(value: Any) -> int:
    """How deeply objects and arrays nest in ``value`` (iterative: no recursion limit to hit)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_SCHEMA_DEPTH:
                todo.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _rebuild(kind: str, canonical: str, param: str) -> GuidedSpec:
    """The spec of canonical text ``canonical``; its value is that text (JSON text is a valid JSON
    schema value), the list for a choice (flat: safe to parse), None for a JSON object."""
    value = json.loads(canonical) if kind == "choice" else canonical if kind != "json_object" else None
    spec = object.__new__(GuidedSpec)
    spec._fill(kind, value, param, canonical)
    return spec


def choice_to_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _ebnf_literal(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
