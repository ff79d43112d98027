"""UTF-8-encoded surrogates stay out of constrained output (``SurrogateGuard``).

xgrammar 0.2.9 accepts the bytes ED A0 80 inside a JSON string as one character; they decode to
three U+FFFD, so a soak run's ``maxLength: 8`` answer came out 10 characters long (CI, stop 33).
"""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.structured import GrammarCache, GuidedSpec, allocate_bitmask, build_tokenizer_info, new_matcher

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}


@pytest.fixture(scope="module")
def tok(embedded_hf_tokenizer):
    return embedded_hf_tokenizer


@pytest.fixture(scope="module")
def cache(tok):
    c = GrammarCache(build_tokenizer_info(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id]),
                     compile_threads=1)
    yield c
    c.close()


def byte_token(cache, value: int) -> int:
    """The id of the token that is the single byte ``value``."""
    return cache.tokenizer_info.decoded_vocab.index(bytes([value]))


def allowed(matcher, vocab: int, token: int) -> bool:
    bitmask = allocate_bitmask(1, vocab)
    matcher.fill_mask(bitmask, 0)
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def test_a_surrogate_cannot_follow_a_lone_ed_byte(tok, cache):
    compiled = cache.get_or_compile(GuidedSpec.json_schema(SCHEMA))
    m = new_matcher(compiled, stop_token_ids=[tok.eos_token_id], utf8_guard=cache.utf8_guard)
    for t in tok.encode('{"name": "ab', add_special_tokens=False):
        assert m.accept(t)
    ed, a0, x9f, x80 = (byte_token(cache, b) for b in (0xED, 0xA0, 0x9F, 0x80))
    assert m.accept(ed)
    vocab = cache.vocab_size
    assert not allowed(m, vocab, a0)  # ED A0 .. is U+D800, a surrogate
    assert not m.accept(a0)
    assert m.validate_tokens([a0, x80]) == 0
    assert allowed(m, vocab, x9f)  # ED 9F BF is U+D7FF, a real character
    assert m.validate_tokens([x9f, byte_token(cache, 0xBF)]) == 2
    # rolled back past the ED, a continuation byte is a plain character's again; the ED given back, guarded
    m.rollback(1)
    assert m.validate_tokens([a0]) == 0  # a lone continuation byte is no character: xgrammar refuses it
    assert m.accept(ed) and not m.accept(a0)


def test_guarded_random_walks_always_decode_to_valid_json(tok, cache):
    """Uniform walks through the schema, with the continuation bytes after ED favoured: every
    finished walk decodes to JSON that validates (with U+FFFD counted as the text has it)."""
    compiled = cache.get_or_compile(GuidedSpec.json_schema(SCHEMA))
    guard = cache.utf8_guard
    favoured = torch.tensor([i for i, ok in enumerate(guard.makes_surrogate) if ok] + [byte_token(cache, 0xED)])
    vocab = cache.vocab_size
    bitmask = allocate_bitmask(1, vocab)
    gen = torch.Generator().manual_seed(0)
    finished = 0
    for _ in range(40):
        m = new_matcher(compiled, stop_token_ids=[tok.eos_token_id], utf8_guard=guard)
        out: list[int] = []
        for _ in range(60):
            m.fill_mask(bitmask, 0)
            bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
            ok = bits.reshape(-1)[:vocab].bool()
            scores = torch.rand(vocab, generator=gen)
            scores[favoured] += 1.0
            token = int(torch.where(ok, scores, -1.0).argmax())
            assert m.accept(token)
            if m.is_terminated():
                break
            out.append(token)
        if m.is_terminated():
            finished += 1
            jsonschema.validate(json.loads(tok.decode(out)), SCHEMA)
    assert finished >= 20
