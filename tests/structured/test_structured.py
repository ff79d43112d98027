"""Structured output (kvserve.structured): specs, the grammar cache, matchers and token masks.

Random walks drive a matcher with uniformly random allowed tokens (argmax of uniform random
logits after masking) from the embedded model's tokenizer until it accepts a stop token; the
decoded text must then be valid for the spec (json.loads in strict mode + jsonschema, re.fullmatch,
the choice list, a parser for the arithmetic grammar).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading

import pytest
import torch

from kvserve.errors import InvalidArgumentError
from kvserve.structured import (
    GrammarCache,
    GrammarMatcher,
    GuidedSpec,
    allocate_bitmask,
    apply_masks,
    build_tokenizer_info,
    fill_masks,
)

jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Masks here are small; a second intra-op thread only waits for a core when the machine
    is shared (each op then took ~8 ms instead of ~0.05 ms on a busy 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tok(embedded_hf_tokenizer):
    return embedded_hf_tokenizer


@pytest.fixture(scope="module")
def info(tok):
    return build_tokenizer_info(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])


@pytest.fixture(scope="module")
def cache(info):
    c = GrammarCache(info, max_size=64, compile_threads=2)
    yield c
    c.close()


def allowed_ids(bitmask: torch.Tensor, row: int = 0) -> set[int]:
    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.reshape(-1).nonzero().view(-1).tolist())


def walk(cache: GrammarCache, spec: GuidedSpec, seed: int, cap: int = 400) -> tuple[list[int], bool]:
    """Sample uniformly among allowed tokens until a stop token or ``cap`` tokens."""
    compiled = cache.get_or_compile(spec)
    m = GrammarMatcher(compiled)
    gen = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, cache.vocab_size)
    out: list[int] = []
    for _ in range(cap):
        m.fill_mask(bitmask, 0)
        logits = torch.rand(1, cache.vocab_size, generator=gen)
        apply_masks(logits, bitmask, [0])
        token = int(logits.argmax())
        assert torch.isfinite(logits[0, token])
        assert m.accept(token), f"an allowed token {token} was rejected"
        if m.is_terminated():
            assert token in m.stop_token_ids
            return out, True
        out.append(token)
    return out, False


def walk_texts(tok, cache, spec, seeds, cap=400, min_terminated=0.9) -> list[str]:
    texts, unfinished = [], 0
    for seed in seeds:
        tokens, done = walk(cache, spec, seed, cap)
        if done:
            texts.append(tok.decode(tokens))
        else:
            unfinished += 1
    assert len(texts) >= min_terminated * len(seeds), f"{unfinished} of {len(seeds)} walks hit the cap"
    return texts


# --------------------------------------------------------------------------- specs


def test_cache_key_is_stable_and_canonical():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    a = GuidedSpec.json_schema(schema)
    b = GuidedSpec.json_schema(json.dumps(schema, indent=4))
    assert a.cache_key == b.cache_key and a == b and hash(a) == hash(b)
    expected = hashlib.sha256(("json_schema\n" + json.dumps(schema, separators=(",", ":"))).encode()).hexdigest()
    assert a.cache_key == expected  # the same in every process: no salted hash() in it
    # property order is part of the grammar (the output follows it), so it is part of the key
    swapped = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    assert GuidedSpec.json_schema(swapped).cache_key != a.cache_key
    # a choice is a set of strings
    assert GuidedSpec.choice(["x", "y", "x"]).cache_key == GuidedSpec.choice(("y", "x")).cache_key
    # the kind is part of the key; param is not
    assert GuidedSpec.regex("abc").cache_key != GuidedSpec.grammar("abc").cache_key
    assert GuidedSpec.regex("abc", param="x") == GuidedSpec.regex("abc")
    assert GuidedSpec.json_object().cache_key == GuidedSpec("json_object", {"ignored": 1}).cache_key
    with pytest.raises(AttributeError):
        a.kind = "regex"  # type: ignore[misc]


@pytest.mark.parametrize("kind, value", [
    ("nope", "x"), ("json_schema", "{not json"), ("json_schema", "[1, 2]"), ("choice", []), ("choice", "ab"),
    ("choice", ["a", 1]), ("regex", ""), ("grammar", None),
])
def test_malformed_spec_values_are_rejected(kind, value):
    with pytest.raises(InvalidArgumentError):
        GuidedSpec(kind, value)


@pytest.mark.parametrize("spec, param, words", [
    (GuidedSpec.json_schema({"type": 12}), "response_format", "JSON schema"),
    (GuidedSpec.json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
     "response_format", "JSON schema"),
    (GuidedSpec.regex("a(b"), "guided_regex", "regular expression"),
    (GuidedSpec.regex("[z-a]", param="structured_outputs.regex"), "structured_outputs.regex", "regular expression"),
    (GuidedSpec.grammar('root ::= undefined_rule'), "guided_grammar", "grammar"),
    (GuidedSpec.grammar('root ::= "a" |'), "guided_grammar", "grammar"),
])
def test_invalid_specs_raise_invalid_argument(cache, spec, param, words):
    before = cache.stats().errors
    with pytest.raises(InvalidArgumentError) as err:
        cache.get_or_compile(spec)
    assert err.value.param == param
    message = str(err.value)
    assert message.startswith(f"invalid {words}: ") and len(message) > len(words) + 12
    assert ".cc:" not in message  # the C++ log prefix is stripped
    assert cache.stats().errors == before + 1
    assert spec not in cache


# --------------------------------------------------------------------------- cache


def test_lru_bound_and_counters(info):
    cache = GrammarCache(info, max_size=2, compile_threads=1)
    a, b, c = (GuidedSpec.regex(p) for p in ("a+", "b+", "c+"))
    ga = cache.get_or_compile(a)
    cache.get_or_compile(b)
    assert cache.get_or_compile(a) is ga  # hit; a is now the most recent
    cache.get_or_compile(c)  # evicts b
    s = cache.stats()
    assert (s.size, s.compiles, s.hits, s.evictions) == (2, 3, 1, 1)
    assert a in cache and c in cache and b not in cache
    assert s.compile_seconds_total > 0 and s.bytes > 0
    cache.get_or_compile(b)  # compiled again, evicting a, now the least recently used
    s = cache.stats()
    assert (s.compiles, s.evictions) == (4, 2) and a not in cache and c in cache
    cache.close()


def test_cache_stays_bounded_over_1000_schemas(info):
    cache = GrammarCache(info, max_size=8, compile_threads=1)
    for i in range(1000):
        spec = GuidedSpec.json_schema({"type": "object", "properties": {f"k{i}": {"type": "integer", "maximum": i}},
                                       "required": [f"k{i}"]})
        cache.get_or_compile(spec)
        assert len(cache) <= 8
    s = cache.stats()
    assert (s.size, s.compiles, s.evictions) == (8, 1000, 992)
    assert 0 < s.bytes < 8 * 64 * 1024  # only the 8 live grammars are counted
    cache.close()


COSTLY_REGEX = "(" + "(a|b)*" * 200 + ")"  # 1.2 KB; ~18 s to compile here


def test_compile_time_limit_kills_the_compile_and_refuses_the_spec(tok, info):
    """A grammar over the time limit is refused (400) without costing the engine its compile:
    the child process is killed, the spec is refused at once afterwards, and the next compile runs
    in a new child and matches an in-process compile."""
    cache = GrammarCache(info, max_size=4, compile_threads=1, compile_timeout_s=1.0)
    try:
        schema = GuidedSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}},
                                         "required": ["n"]})
        walked = walk(cache, schema, seed=1)  # compiled in the child, sent back serialized
        with pytest.raises(InvalidArgumentError, match="took longer than 1 s to compile") as e:
            cache.get_or_compile(GuidedSpec.regex(COSTLY_REGEX))
        assert e.value.param == "guided_regex"
        first = cache._worker.restarts
        with pytest.raises(InvalidArgumentError, match="took longer"):
            cache.get_or_compile(GuidedSpec.regex(COSTLY_REGEX))  # remembered: no second attempt
        assert cache._worker.restarts == first
        with pytest.raises(InvalidArgumentError, match="invalid regular expression"):
            cache.get_or_compile(GuidedSpec.regex("(("))  # xgrammar's own refusal, from the new child
        assert cache._worker.restarts == first + 1
        regex = GuidedSpec.regex("[0-9]{2}-[a-z]{2}")
        in_process = GrammarCache(info, max_size=4, compile_threads=1)
        for seed in range(3):
            assert walk(cache, regex, seed) == walk(in_process, regex, seed)
        assert walk(in_process, schema, seed=1) == walked
        in_process.close()
        assert cache.stats().errors == 3
    finally:
        cache.close()


def test_a_crashing_compile_costs_the_child_not_the_caller(info):
    cache = GrammarCache(info, max_size=4, compile_threads=1, compile_timeout_s=60.0)
    try:
        cache.get_or_compile(GuidedSpec.regex("x+"))  # the child is up
        proc = cache._worker._proc
        threading.Timer(0.5, proc.kill).start()  # dies mid-compile, as a segfault would
        with pytest.raises(InvalidArgumentError, match="crashed"):
            cache.get_or_compile(GuidedSpec.regex(COSTLY_REGEX))
        assert cache.get_or_compile(GuidedSpec.regex("y+")) is not None
    finally:
        cache.close()


def test_concurrent_requests_compile_once(info):
    cache = GrammarCache(info, max_size=4, compile_threads=1, workers=4)
    spec = GuidedSpec.json_schema({"type": "array", "items": {"type": "number"}, "maxItems": 5})
    results, barrier = [], threading.Barrier(6)

    def worker():
        barrier.wait()
        results.append(cache.get_or_compile(spec))

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    futures = [cache.submit(spec) for _ in range(3)]
    assert all(f.result(timeout=10) is results[0] for f in futures)
    assert all(r is results[0] for r in results)
    s = cache.stats()
    assert s.compiles == 1 and s.hits == 8
    bad = cache.submit(GuidedSpec.regex("(unclosed"))
    with pytest.raises(InvalidArgumentError):
        bad.result(timeout=10)
    fresh = cache.submit(GuidedSpec.regex("[0-9]{2}"))
    assert GrammarMatcher(fresh.result(timeout=10)).validate_tokens([]) == 0
    cache.close()


# --------------------------------------------------------------------------- random walks

SCHEMAS = [
    {  # nested object, enums, bounded numbers, arrays, required fields
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "number", "minimum": -5, "maximum": 5},
            "status": {"enum": ["active", "inactive", "pending"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8},
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["zip"],
            },
        },
        "required": ["name", "age", "status", "address"],
    },
    {  # array of objects, booleans, negative bounds
        "type": "array",
        "minItems": 1,
        "maxItems": 3,
        "items": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -10, "maximum": 10}, "ok": {"type": "boolean"},
                           "kind": {"const": "point"}},
            "required": ["x", "ok"],
        },
    },
    {  # alternatives and null
        "type": "object",
        "properties": {
            "id": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 999}, {"type": "string", "maxLength": 4}]},
            "note": {"type": ["string", "null"], "maxLength": 5},
            "level": {"enum": [1, 2, 3, "max"]},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        },
        "required": ["id", "level", "ratio"],
    },
]


@pytest.mark.parametrize("schema_index", range(len(SCHEMAS)))
def test_random_walks_produce_valid_json(tok, cache, schema_index):
    schema = SCHEMAS[schema_index]
    texts = walk_texts(tok, cache, GuidedSpec.json_schema(schema), seeds=range(12))
    for text in texts:
        value = json.loads(text)  # strict: raw control characters in strings are invalid JSON
        jsonschema.validate(value, schema)


def test_bounded_strings_exclude_raw_control_characters(tok, cache):
    # xgrammar 0.2.9 lets a string with maxLength hold raw control characters (invalid JSON)
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 30}}, "required": ["s"]}
    m = GrammarMatcher(cache.get_or_compile(GuidedSpec.json_schema(schema)))
    for t in tok.encode('{"s": "a', add_special_tokens=False):
        assert m.accept(t)
    bitmask = allocate_bitmask(1, cache.vocab_size)
    m.fill_mask(bitmask)
    allowed = allowed_ids(bitmask)
    controls = [t for t in tok.encode("\t\x01\x18\x1f", add_special_tokens=False)
                if any(ord(c) < 0x20 for c in tok.decode([t]))]
    assert controls and not (set(controls) & allowed)
    assert tok.encode("b", add_special_tokens=False)[0] in allowed


def test_json_object_walk_stays_a_valid_prefix(tok, cache):
    spec = GuidedSpec.json_object()
    m = GrammarMatcher(cache.get_or_compile(spec))
    bitmask = allocate_bitmask(1, cache.vocab_size)
    m.fill_mask(bitmask)
    assert all(tok.decode([t]).lstrip().startswith("{") for t in allowed_ids(bitmask))
    good = tok.encode('{"a": [1, 2.5, {"b": null}], "c": "d\\n"}', add_special_tokens=False)
    assert m.validate_tokens(good) == len(good)
    assert m.validate_tokens(tok.encode("[1]", add_special_tokens=False)) == 0
    for seed in range(3):  # unbounded: just check that every sampled token is accepted
        walk(cache, spec, seed, cap=60)


@pytest.mark.parametrize("pattern", [
    r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)",
    r"\d{3}-\d{4}",
    r"-?(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?",
    r"(yes|no|maybe)!?",
])
def test_random_walks_match_regex(tok, cache, pattern):
    for text in walk_texts(tok, cache, GuidedSpec.regex(pattern), seeds=range(10), cap=100, min_terminated=1.0):
        assert re.fullmatch(pattern, text), text


def test_random_walks_pick_one_choice(tok, cache):
    choices = ["yes", "no", "maybe so", 'say "hi"', "back\\slash", "naïve café", "two\nlines", "tab\there"]
    seen = set()
    for text in walk_texts(tok, cache, GuidedSpec.choice(choices), seeds=range(40), cap=50, min_terminated=1.0):
        assert text in choices, repr(text)
        seen.add(text)
    assert len(seen) >= 4  # the walk is random, not stuck on one branch


ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= num | "(" inner ")"
inner ::= iterm (("+" | "-") iterm){0,2}
iterm ::= num (("*" | "/") num){0,1}
num ::= "-"? [0-9]{1,3}
"""


def parses_arithmetic(text: str) -> bool:
    """A recursive-descent parser for the language ARITHMETIC generates (parentheses may nest)."""
    pos = 0

    def num() -> bool:
        nonlocal pos
        start = pos + (text[pos:pos + 1] == "-")
        end = start
        while end < len(text) and text[end].isdigit():
            end += 1
        if end == start or end - start > 3:
            return False
        pos = end
        return True

    def factor() -> bool:
        nonlocal pos
        if text[pos:pos + 1] == "(":
            pos += 1
            if not expr() or text[pos:pos + 1] != ")":
                return False
            pos += 1
            return True
        return num()

    def chain(item, ops: str) -> bool:
        nonlocal pos
        if not item():
            return False
        while text[pos:pos + 1] and text[pos] in ops:
            pos += 1
            if not item():
                return False
        return True

    def expr() -> bool:
        return chain(lambda: chain(factor, "*/"), "+-")

    return expr() and pos == len(text)


def test_parser_sanity():
    assert parses_arithmetic("1+2*(3-4)/-5") and parses_arithmetic("(1)")
    assert not parses_arithmetic("1+") and not parses_arithmetic("(1") and not parses_arithmetic("1234")


def test_random_walks_parse_as_arithmetic(tok, cache):
    texts = walk_texts(tok, cache, GuidedSpec.grammar(ARITHMETIC), seeds=range(25), cap=150, min_terminated=1.0)
    for text in texts:
        assert parses_arithmetic(text), text
    assert any("(" in t for t in texts) and any(op in "".join(texts) for op in "*/")


# --------------------------------------------------------------------------- matcher


def test_stop_tokens_and_termination(tok, cache):
    eos = tok.eos_token_id
    compiled = cache.get_or_compile(GuidedSpec.choice(["yes", "no"]))
    m = GrammarMatcher(compiled)
    assert m.stop_token_ids == [eos]
    bitmask = allocate_bitmask(1, cache.vocab_size)
    m.fill_mask(bitmask)
    assert eos not in allowed_ids(bitmask)
    for t in tok.encode("yes", add_special_tokens=False):
        assert m.accept(t)
    assert m.is_completed() and not m.is_terminated()
    m.fill_mask(bitmask)
    assert allowed_ids(bitmask) == {eos}  # nothing can follow "yes": only the stop token
    assert not m.accept(tok.encode(" no", add_special_tokens=False)[0])
    assert m.accept(eos) and m.is_terminated()
    with pytest.raises(RuntimeError):
        m.fill_mask(bitmask)
    assert not m.accept(eos)  # nothing after the stop token
    m.rollback(1)  # e.g. a drafted EOS was rejected
    assert not m.is_terminated() and m.is_completed()
    # per-request stop tokens (e.g. the model's eos ids + the request's stop_token_ids)
    m2 = GrammarMatcher(compiled, stop_token_ids=[0, eos])
    for t in tok.encode("no", add_special_tokens=False):
        m2.accept(t)
    m2.fill_mask(bitmask)
    assert allowed_ids(bitmask) == {0, eos}


def test_special_tokens_are_never_text(tok, cache):
    m = GrammarMatcher(cache.get_or_compile(GuidedSpec.json_schema({"type": "string", "maxLength": 20})))
    m.accept(tok.encode('"', add_special_tokens=False)[0])
    bitmask = allocate_bitmask(1, cache.vocab_size)
    m.fill_mask(bitmask)
    allowed = allowed_ids(bitmask)
    specials = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    assert specials and not (allowed & specials)
    assert len(allowed) > 40000  # ordinary text tokens are allowed inside a string


def test_rollback_and_validate_tokens(tok, cache):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 9}},
              "required": ["a", "b"]}
    compiled = cache.get_or_compile(GuidedSpec.json_schema(schema))
    tokens = tok.encode('{"a": 12, "b": "hello"}', add_special_tokens=False)
    m = GrammarMatcher(compiled)
    fresh = allocate_bitmask(1, cache.vocab_size)
    m.fill_mask(fresh)
    assert m.validate_tokens(tokens) == len(tokens)
    assert m.num_accepted == 0
    bad = tokens[:4] + tok.encode("x", add_special_tokens=False) + tokens[4:]
    assert m.validate_tokens(bad) == 4
    after = allocate_bitmask(1, cache.vocab_size)
    m.fill_mask(after)
    assert torch.equal(fresh, after)  # validating never changes the state

    # speculative step: accept the drafted prefix the grammar allows, then the target model
    # rejects the last two drafted tokens: roll them back and compare with a straight run
    k = m.validate_tokens(bad)
    for t in bad[:k]:
        assert m.accept(t)
    m.rollback(2)
    straight = GrammarMatcher(compiled)
    for t in tokens[:k - 2]:
        straight.accept(t)
    a, b = allocate_bitmask(1, cache.vocab_size), allocate_bitmask(1, cache.vocab_size)
    m.fill_mask(a)
    straight.fill_mask(b)
    assert torch.equal(a, b) and m.num_accepted == k - 2
    with pytest.raises(ValueError):
        m.rollback(k)
    for t in tokens[k - 2:]:
        assert m.accept(t)
    assert m.is_completed() and m.accept(tok.eos_token_id) and m.is_terminated()
    assert m.validate_tokens(tokens) == 0
    m.reset()
    assert m.num_accepted == 0 and not m.is_terminated() and m.validate_tokens(tokens) == len(tokens)


# --------------------------------------------------------------------------- masks


def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, row: int) -> torch.Tensor:
    out = torch.full_like(logits[row], float("-inf"))
    allowed = torch.tensor(sorted(allowed_ids(bitmask, row)), dtype=torch.long)
    out[allowed] = logits[row, allowed]
    return out


def test_masks_touch_only_constrained_rows(tok, cache):
    compiled = cache.get_or_compile(GuidedSpec.regex(r"[0-9]+"))
    m1, m3 = GrammarMatcher(compiled), GrammarMatcher(compiled)
    m3.accept(tok.encode("7", add_special_tokens=False)[0])
    done = GrammarMatcher(compiled)
    done.accept(tok.encode("1", add_special_tokens=False)[0])
    done.accept(tok.eos_token_id)
    bitmask, rows = fill_masks([None, m1, None, m3, done])
    assert rows == [1, 3] and bitmask is not None and bitmask.shape[0] == 5
    assert torch.all(bitmask[[0, 2, 4]] == -1)
    logits = torch.randn(5, cache.vocab_size, generator=torch.Generator().manual_seed(0))
    original = logits.clone()
    apply_masks(logits, bitmask, rows)
    for r in (0, 2, 4):
        assert torch.equal(logits[r], original[r])
    for r in rows:
        assert torch.equal(logits[r], reference_apply(original, bitmask, r))
    assert tok.eos_token_id not in allowed_ids(bitmask, 1) and tok.eos_token_id in allowed_ids(bitmask, 3)
    # all rows at once, and a reused bitmask
    full = original[[1, 3]].clone()
    apply_masks(full, bitmask[[1, 3]], None)
    assert torch.equal(full, logits[[1, 3]])
    again, rows2 = fill_masks([m1, None], out=bitmask)
    assert again is bitmask and rows2 == [0] and torch.all(bitmask[1] == -1)
    assert fill_masks([None, None]) == (None, [])
    apply_masks(logits, bitmask, [])  # nothing to do


def test_padded_vocabulary(tok):
    padded = len(tok) + 64  # a model whose lm_head is wider than the tokenizer
    cache = GrammarCache.from_tokenizer(tok, vocab_size=padded, max_size=4, compile_threads=1)
    assert cache.vocab_size == padded
    m = GrammarMatcher(cache.get_or_compile(GuidedSpec.json_schema({"type": "string", "maxLength": 3})))
    m.accept(tok.encode('"', add_special_tokens=False)[0])
    bitmask, rows = fill_masks([m])
    assert bitmask.shape[1] == (padded + 31) // 32
    assert not any(i >= len(tok) for i in allowed_ids(bitmask))
    logits = torch.zeros(1, padded)
    apply_masks(logits, bitmask, rows)
    assert torch.all(torch.isinf(logits[0, len(tok):]))
    cache.close()


def test_logits_wider_than_the_mask(tok, cache):
    # a mask built for the tokenizer's size applied to wider logits: the extra ids are disallowed
    m = GrammarMatcher(cache.get_or_compile(GuidedSpec.regex("a+")))
    bitmask, rows = fill_masks([m])
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.zeros(1, cache.vocab_size + 40, dtype=dtype)
        apply_masks(logits, bitmask, rows)
        finite = torch.isfinite(logits[0]).nonzero().view(-1).tolist()
        assert finite and set(finite) == allowed_ids(bitmask) and max(finite) < cache.vocab_size


def test_a_special_stop_token_is_refused_quietly(tok, cache, capfd):
    """A request's stop_token_ids may name a special token; xgrammar refuses those with a warning
    per call (the fuzzer's logs filled with them). The matcher refuses them itself, silently: the
    request ends on such a token anyway."""
    special = next(i for i in cache.tokenizer_info.special_token_ids if i != tok.eos_token_id)
    m = GrammarMatcher(cache.get_or_compile(GuidedSpec.choice(["yes", "no"])),
                       stop_token_ids=[tok.eos_token_id, special])
    assert not m.accept(special) and m.validate_tokens([special]) == 0
    assert m.accept(tok.encode("yes")[0])
    assert "cannot accept special token" not in "".join(capfd.readouterr())
