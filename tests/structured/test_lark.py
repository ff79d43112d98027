"""Lark grammars through llguidance (kvserve.structured.lark): the same masks as xgrammar for the
same language, the matcher contract (refusal leaves the state unchanged, stop tokens, rollback,
validate_tokens), random walks that parse, and invalid grammars as 400s naming the field."""

from __future__ import annotations

import pytest
import torch

from kvserve.errors import InvalidArgumentError
from kvserve.structured import GrammarCache, GuidedSpec, allocate_bitmask, apply_masks, new_matcher
from kvserve.structured.lark import LarkMatcher, looks_like_lark
from test_structured import ARITHMETIC, allowed_ids, parses_arithmetic

pytest.importorskip("llguidance")

LARK_ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term)~0..3
term: factor (("*" | "/") factor)~0..2
factor: NUM | "(" inner ")"
inner: iterm (("+" | "-") iterm)~0..2
iterm: NUM (("*" | "/") NUM)?
NUM: /-?[0-9]{1,3}/
"""


@pytest.fixture(scope="module")
def tok(embedded_hf_tokenizer):
    return embedded_hf_tokenizer


@pytest.fixture(scope="module")
def cache(tok):
    c = GrammarCache.from_tokenizer(tok, len(tok), [tok.eos_token_id], max_size=16)
    yield c
    c.close()


def test_lark_is_told_from_ebnf():
    assert looks_like_lark(LARK_ARITHMETIC) and not looks_like_lark(ARITHMETIC)


def test_masks_agree_with_xgrammar_along_a_path(tok, cache):
    # llguidance allows only the canonical tokens of a forced literal (" so", not " " then "so"):
    # its masks are a subset of xgrammar's for the same language, and hold the canonical path
    lark = new_matcher(cache.get_or_compile(GuidedSpec.grammar('start: "yes" | "no" | "maybe so"')))
    ebnf = new_matcher(cache.get_or_compile(GuidedSpec.grammar('root ::= "yes" | "no" | "maybe so"')))
    assert isinstance(lark, LarkMatcher) and not isinstance(ebnf, LarkMatcher)
    a, b = allocate_bitmask(1, cache.vocab_size), allocate_bitmask(1, cache.vocab_size)
    for token in [*tok.encode("maybe so", add_special_tokens=False), tok.eos_token_id]:
        lark.fill_mask(a)
        ebnf.fill_mask(b)
        assert token in allowed_ids(a) and allowed_ids(a) <= allowed_ids(b)
        assert lark.accept(token) and ebnf.accept(token)
    assert lark.is_terminated() and ebnf.is_terminated()


def test_matcher_contract(tok, cache):
    eos = tok.eos_token_id
    m = new_matcher(cache.get_or_compile(GuidedSpec.grammar('start: "yes" | "no"')), stop_token_ids=[0, eos])
    bitmask = allocate_bitmask(1, cache.vocab_size)
    m.fill_mask(bitmask)
    assert not allowed_ids(bitmask) & {0, eos}  # nothing complete yet: no stop token
    no = tok.encode("no", add_special_tokens=False)
    assert not m.accept(tok.encode("maybe", add_special_tokens=False)[0])  # refused, state unchanged
    assert not m.accept(eos)
    assert m.validate_tokens([*no, eos, eos]) == len(no) + 1 and m.num_accepted == 0
    assert all(m.accept(t) for t in no) and m.is_completed()
    m.fill_mask(bitmask)
    assert allowed_ids(bitmask) == {0, eos}  # complete, and nothing else can follow
    assert m.accept(0) and m.is_terminated() and not m.is_completed()
    with pytest.raises(RuntimeError):
        m.fill_mask(bitmask)
    m.rollback(1 + len(no))  # the stop token and the text
    assert m.num_accepted == 0 and not m.is_terminated()
    m.fill_mask(bitmask)
    assert tok.encode("yes", add_special_tokens=False)[0] in allowed_ids(bitmask)
    with pytest.raises(ValueError):
        m.rollback(1)


def test_random_walks_parse_as_arithmetic(tok, cache):
    compiled = cache.get_or_compile(GuidedSpec.grammar(LARK_ARITHMETIC))
    texts = []
    for seed in range(15):
        m, gen = new_matcher(compiled), torch.Generator().manual_seed(seed)
        bitmask, out = allocate_bitmask(1, cache.vocab_size), []
        for _ in range(150):
            m.fill_mask(bitmask)
            logits = torch.rand(1, cache.vocab_size, generator=gen)
            apply_masks(logits, bitmask, [0])
            token = int(logits.argmax())
            assert m.accept(token)
            if m.is_terminated():
                break
            out.append(token)
        assert m.is_terminated(), f"walk {seed} did not end"
        texts.append(tok.decode(out))
    assert all(parses_arithmetic(t) for t in texts), texts


@pytest.mark.parametrize("grammar, words", [
    ("start: foo", "unknown name"),
    ('start: "a" (', "Lark"),
])
def test_invalid_lark_is_a_400_naming_the_field(cache, grammar, words):
    with pytest.raises(InvalidArgumentError) as e:
        cache.get_or_compile(GuidedSpec("grammar", grammar, param="structured_outputs"))
    assert e.value.param == "structured_outputs" and words in str(e.value)
