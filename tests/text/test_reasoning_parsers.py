"""The reasoning parsers: what a whole text splits into, and that every cut of a stream agrees with it."""

from __future__ import annotations

import itertools

import pytest

from kvserve.errors import InvalidArgumentError
from kvserve.text.reasoning import (
    REASONING_PARSERS, DeepSeekR1ReasoningParser, ReasoningSplitter, check_reasoning_parser,
    register_reasoning_parser,
)

SAMPLES = [
    "<think>\nTwo and two.\n</think>\n\nIt is 4.",
    "Two and two.</think>It is 4.",  # DeepSeek-R1: the template opened the block in the prompt
    " \n<think>a<b</think>",  # whitespace first; a "<" inside; nothing after the block
    "<think></think>Just this.",
    "<think>cut off while thin",
    "No tags at all.",
    "It is <think>not</think> reasoning here.",
    "<thi",
    "a</think>b</think>c<think>d",
    "",
]

WHOLE = {  # (reasoning, content) of each sample, by parser
    "deepseek_r1": [
        ("\nTwo and two.\n", "\n\nIt is 4."), ("Two and two.", "It is 4."), ("a<b", None), (None, "Just this."),
        ("cut off while thin", None), ("No tags at all.", None), ("It is <think>not", " reasoning here."),
        ("<thi", None), ("a", "b</think>c<think>d"), (None, None),
    ],
    "qwen3": [
        ("\nTwo and two.\n", "\n\nIt is 4."), (None, "Two and two.</think>It is 4."), ("a<b", None),
        (None, "Just this."), ("cut off while thin", None), (None, "No tags at all."),
        (None, "It is <think>not</think> reasoning here."), (None, "<thi"), (None, "a</think>b</think>c<think>d"),
        (None, None),
    ],
}


def streamed(splitter: ReasoningSplitter, pieces: list[str]) -> tuple[str | None, str | None]:
    """The reasoning and content of a stream of ``pieces``, joined; no reasoning once content has come."""
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        now = splitter.delta(0, piece, finished=i == len(pieces) - 1)
        assert not (content and now.reasoning), f"reasoning after content: {pieces}"
        reasoning += now.reasoning
        content += now.content
    return reasoning or None, content or None


def cuts(text: str, parts: int) -> list[list[str]]:
    """Every way to cut ``text`` into ``parts`` pieces (empty ones too: a delta may carry no text)."""
    out = []
    for points in itertools.combinations_with_replacement(range(len(text) + 1), parts - 1):
        bounds = [0, *points, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:])])
    return out


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_whole_texts(name):
    assert [ReasoningSplitter.of(name).whole(t) for t in SAMPLES] == WHOLE[name]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("sample", range(len(SAMPLES)))
def test_every_cut_into_two_or_three_deltas_agrees_with_the_whole_text(name, sample):
    text = SAMPLES[sample]
    for parts in (1, 2, 3):
        for pieces in cuts(text, parts):
            assert streamed(ReasoningSplitter.of(name), pieces) == WHOLE[name][sample], pieces


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_a_tag_cut_in_the_middle_is_held_back_not_sent(name):
    splitter = ReasoningSplitter.of(name)
    assert splitter.delta(0, "<thi", False) == ("", "")  # may be <think>: wait
    assert splitter.delta(0, "nk>Hmm</th", False) == ("Hmm", "")  # "</th" may be </think>: held
    assert splitter.delta(0, "ink>Yes", False) == ("", "Yes")
    assert splitter.delta(0, " <think>", True) == ("", " <think>")  # after the block, tags are content


def test_choices_keep_their_own_state():
    splitter = ReasoningSplitter.of("deepseek_r1")
    assert splitter.delta(0, "a</think>", False) == ("a", "")
    assert splitter.delta(1, "b", False) == ("b", "")  # choice 1 is still thinking
    assert splitter.delta(0, "c", True) == ("", "c")
    assert splitter.delta(1, "</think>d", True) == ("", "d")


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_enable_thinking_false_makes_everything_content(name):
    for kwargs in ({"enable_thinking": False}, {"enable_thinking": False, "other": 1}):
        splitter = ReasoningSplitter.of(name, kwargs)
        for text in SAMPLES:
            assert splitter.whole(text) == (None, text or None)
            for pieces in cuts(text, 2):
                assert streamed(ReasoningSplitter.of(name, kwargs), pieces) == (None, text or None)
    # only false turns it off (a template may take other values: they change nothing here)
    assert ReasoningSplitter.of(name, {"enable_thinking": True}).whole(SAMPLES[0]) == WHOLE[name][0]
    assert ReasoningSplitter.of(name, {}).whole(SAMPLES[0]) == WHOLE[name][0]


def test_the_registry():
    with pytest.raises(InvalidArgumentError, match="deepseek_r1, qwen3") as e:
        check_reasoning_parser("nope")
    assert e.value.param == "reasoning_parser"
    with pytest.raises(InvalidArgumentError):
        ReasoningSplitter.of("nope")

    class Always(DeepSeekR1ReasoningParser):
        pass

    register_reasoning_parser("test_always", Always)
    try:
        check_reasoning_parser("test_always")
        assert ReasoningSplitter.of("test_always").whole("x</think>y") == ("x", "y")
    finally:
        del REASONING_PARSERS["test_always"]
