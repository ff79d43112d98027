"""The bodies the API fuzzer sends (see fuzz_utils.py): the ranges the server accepts, values no
schema generator sends (``NASTY``), mutation, and the JSON text of a mutated body."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from typing import Any


class Deep:
    """A value nested ``depth`` lists deep, written straight into the JSON text (json.dumps would recurse)."""

    def __init__(self, depth: int, leaf: str = "1"):
        self.text = "[" * depth + leaf + "]" * depth

    def __repr__(self) -> str:
        return f"Deep({self.text.count('[')})"


NASTY: list[Any] = [
    float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324, -0.0,
    -1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30),
    "\ud800", "a\udfffb", "\ud83d", "\x00", "\u2028\u2029\x85", "\ufeff", "\U0001f600" * 50, "", " ",
    True, False, None, [], {}, [[]], {"": None}, [None], ["\ud800"],
    Deep(200), Deep(600), Deep(5000), Deep(300, '{"type": "object"}'),
]
CONTENT_TYPES = [None, None, None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                 "application/json; charset=latin-1", ""]
# How deep the walks over a body go: deeper dicts and lists are leaves (not copied, marked or offered
# to ``mutate``). The walks use explicit stacks, never recursion, so a deep body costs no Python
# stack, and their memory stays bounded (all paths of a body nested N deep take ~N**2/2 items).
MAX_DEPTH = 64


def _children(o: Any) -> Iterator[tuple[Any, Any]]:
    return iter(o.items()) if isinstance(o, dict) else iter(enumerate(o)) if isinstance(o, list) else iter(())


def _rebuild(body: Any, leaf: Callable[[Any], Any] = lambda v: v) -> Any:
    """A copy of ``body``'s dicts and lists down to ``MAX_DEPTH`` levels (deeper ones shared, not
    copied), every other value within them replaced by ``leaf(value)``."""
    if not isinstance(body, (dict, list)):
        return leaf(body)
    root: Any = {} if isinstance(body, dict) else []
    stack = [(body, root, 0)]  # (original, its copy being filled, depth)
    while stack:
        src, dst, depth = stack.pop()
        for k, v in _children(src):
            if isinstance(v, (dict, list)):
                if depth + 1 < MAX_DEPTH:
                    new: Any = {} if isinstance(v, dict) else []
                    stack.append((v, new, depth + 1))
                    v = new
            else:
                v = leaf(v)
            if isinstance(dst, dict):
                dst[k] = v
            else:
                dst.append(v)
    return root


def dumps_nasty(body: Any) -> bytes:
    """JSON text of ``body``, NaN and infinities as Python writes them, Deep values spliced in."""
    deep: dict[str, str] = {}

    def mark(o: Any) -> Any:
        if isinstance(o, Deep):
            key = f"\x00deep{len(deep)}"
            deep[json.dumps(key)] = o.text
            return key
        return o

    text = json.dumps(_rebuild(body, mark))  # ensure_ascii: lone surrogates travel as \ud800 escapes
    for key, value in deep.items():
        text = text.replace(key, value)
    return text.encode()


def _paths(body: Any) -> list[tuple]:
    """Every place in ``body`` a value can be replaced: each dict value and list item, nested (down
    to ``MAX_DEPTH`` levels), in depth-first order."""
    out: list[tuple] = []
    stack = [((), _children(body))]  # (path, the iterator over its children)
    while stack:
        prefix, items = stack[-1]
        for k, v in items:
            path = (*prefix, k)
            out.append(path)
            if len(path) < MAX_DEPTH and isinstance(v, (dict, list)):
                stack.append((path, _children(v)))
                break  # its children first; this iterator resumes after them
        else:
            stack.pop()
    return out


def mutate(body: dict[str, Any], picks: list[tuple[int, Any]], fields: list[str]) -> dict[str, Any]:
    """``body`` with values replaced: each pick (n, value) replaces the n-th place (counting the
    top-level ``fields`` too, absent ones included) modulo their number. Each value is a copy: a
    later pick may replace a place inside it, which must change neither ``NASTY`` nor, by making a
    value contain itself, the body into a cycle."""
    body = _rebuild(body)
    for n, value in picks:
        places = _paths(body) + [(f,) for f in fields]
        *parents, last = places[n % len(places)]
        target = body
        for p in parents:
            target = target[p]
        target[last] = _rebuild(value)
    return body


def _num(lo: float | None = None, hi: float | None = None, *, integer: bool = False,
         exclusive_lo: bool = False) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "integer" if integer else "number"}
    if lo is not None:
        s["exclusiveMinimum" if exclusive_lo else "minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return s


def _array(items: dict[str, Any], lo: int, hi: int) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


def valid_ranges(vocab_size: int) -> dict[str, dict[str, Any]]:
    """Per request field, the values the server accepts (SamplingParams._check, check_prompt),
    with max_tokens, n, logprobs and sizes kept small so that requests stay cheap."""
    token = _num(0, vocab_size - 1, integer=True)
    text = {"type": "string", "minLength": 1, "maxLength": 40}
    return {
        "max_tokens": _num(1, 16, integer=True),
        "max_completion_tokens": _num(1, 16, integer=True),
        "temperature": _num(0, 2),
        "top_p": _num(0, 1, exclusive_lo=True),
        "top_k": _num(-1, 64, integer=True),
        "min_p": _num(0, 1),
        "repetition_penalty": _num(0, 2, exclusive_lo=True),
        "presence_penalty": _num(-2, 2),
        "frequency_penalty": _num(-2, 2),
        "seed": _num(-(1 << 63), (1 << 64) - 1, integer=True),
        "n": _num(1, 4, integer=True),
        "stop": {"anyOf": [text, _array(text, 1, 4)]},
        "stop_token_ids": _array(token, 0, 4),
        "logprobs": _num(0, 5, integer=True),  # completions: top-n
        "top_logprobs": _num(0, 5, integer=True),
        "echo": {"type": "boolean"},
        "prompt_logprobs": _num(0, 5, integer=True),
        "min_tokens": _num(0, 4, integer=True),
        "logit_bias": {"type": "object", "maxProperties": 4, "additionalProperties": _num(-100, 100),
                       "propertyNames": {"pattern": f"^[0-9]{{1,{len(str(vocab_size - 1)) - 1}}}$"}},
        "allowed_token_ids": _array(token, 1, 8),
        "bad_words": _array(text, 0, 3),
        "prompt": {"anyOf": [
            {"type": "string", "minLength": 1, "maxLength": 100},
            _array(token, 1, 60),
            _array({"type": "string", "minLength": 1, "maxLength": 40}, 1, 3),
            _array(_array(token, 1, 30), 1, 3),
        ]},
        "messages": _array({"type": "object", "required": ["role", "content"], "properties": {
            "role": {"enum": ["system", "user", "assistant"]},
            "content": {"anyOf": [{"type": "string", "maxLength": 60},
                                  _array({"type": "object", "required": ["type", "text"],
                                          "properties": {"type": {"const": "text"},
                                                         "text": {"type": "string", "maxLength": 30}}}, 1, 3)]},
        }}, 1, 3),
    }


def in_range_schema(schema: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """A copy of the OpenAPI schema whose request bodies are narrowed to ``valid_ranges``
    (a field that may be null stays nullable)."""
    schema = copy.deepcopy(schema)
    ranges = valid_ranges(vocab_size)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schema["components"]["schemas"][name]["properties"]
        for key, narrow in ranges.items():
            if key not in props:
                continue
            nullable = any(b.get("type") == "null" for b in props[key].get("anyOf", ()))
            props[key] = {"anyOf": [narrow, {"type": "null"}]} if nullable else narrow
    return schema
