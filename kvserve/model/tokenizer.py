"""Text <-> token ids for the engine: encoding, chat templates and streaming detokenization.

``Tokenizer`` wraps the Hugging Face tokenizer that ``kvserve.model.loader`` built and turns its
failure modes into ``InvalidArgumentError``. ``IncrementalDetokenizer`` turns generated ids into
text deltas one token at a time, never splitting a UTF-8 character across deltas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvserve.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvserve.model.config import ModelConfig
    from kvserve.model.loader import LoadedModel

CHAT_ROLES = ("system", "user", "assistant", "tool")
REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


class Tokenizer:
    """The model's tokenizer, with the engine's view of its special tokens."""

    def __init__(self, hf_tokenizer: Any, config: ModelConfig | None = None):
        self.hf = hf_tokenizer
        # The Rust tokenizer: decoding through it skips transformers' per-call Python overhead and
        # its clean_up_tokenization_spaces pass (which transformers 5 ignores for BPE anyway and
        # which cannot be applied to a stream), so whole and streamed decoding agree exactly.
        self.backend = hf_tokenizer.backend_tokenizer
        eos: list[int] = []
        if hf_tokenizer.eos_token_id is not None:
            eos.append(int(hf_tokenizer.eos_token_id))
        if config is not None:
            eos.extend(int(i) for i in config.eos_token_ids)
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos))
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        # len() counts added tokens too; the model's embedding may have more (padded) rows.
        self.vocab_size: int = len(hf_tokenizer)

    @classmethod
    def from_loaded(cls, loaded: LoadedModel) -> Tokenizer:
        return cls(loaded.tokenizer, loaded.config)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with BOS only if the tokenizer itself adds it (HF's default)."""
        if not isinstance(text, str):
            raise InvalidArgumentError(f"expected text as a string, got {type(text).__name__}", param="prompt")
        check_unicode(text, "the prompt", "prompt")
        return list(self.hf.encode(text))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Render ``messages`` with the model's chat template and tokenize, as HF does."""
        if not self.has_chat_template:
            raise InvalidArgumentError(
                "this model has no chat template; use the completions endpoint with a plain prompt",
                param="messages",
            )
        _check_messages(messages)
        import jinja2

        try:
            ids = self.hf.apply_chat_template(
                [dict(m) for m in messages],
                tokenize=True,
                add_generation_prompt=add_generation_prompt,
                return_dict=False,
            )
        except jinja2.TemplateError as e:  # includes the templates' raise_exception(...)
            raise InvalidArgumentError(f"the chat template rejected the messages: {e}", param="messages") from e
        return [int(i) for i in ids]


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidArgumentError("messages must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidArgumentError(f"messages[{i}] must be an object", param="messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidArgumentError(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", param="messages"
            )
        if not isinstance(message.get("content"), str):
            raise InvalidArgumentError(f"messages[{i}].content must be a string", param="messages")
        for key in ("content", "name"):
            if isinstance(message.get(key), str):
                check_unicode(message[key], f"messages[{i}].{key}", "messages")


def check_unicode(text: str, what: str, param: str) -> None:
    """JSON's \\u escapes can spell a lone UTF-16 surrogate (\\ud800), which no UTF-8 text holds:
    a Python str may carry one, but the tokenizer (and xgrammar) cannot take it."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(f"{what} is not valid Unicode: it holds a lone surrogate {text[e.start]!r}",
                                   param=param) from None


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Keeps a short window of ids: those of the last delta (decoded again only as context, so that
    decoders treating the first token specially, e.g. SentencePiece's leading space, see the token
    before) and those not emitted yet. Each step decodes that window only, so the cost per token
    does not grow with the output. While the window's text ends in U+FFFD, a
    character is still incomplete (its bytes are split across tokens) and nothing is emitted.

    Without ``prompt_ids`` the deltas concatenate to ``tokenizer.decode(output_ids)``. With them,
    the last prompt tokens serve as context, so the first delta carries the space a continuation
    gets in the full text.
    """

    # How many prompt tokens to keep as context: enough for any decoder's look-behind.
    PROMPT_CONTEXT = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ):
        self._backend = tokenizer.backend
        self._skip = skip_special_tokens
        context = list(prompt_ids[-self.PROMPT_CONTEXT :]) if prompt_ids else []
        # ids[:read] were emitted already (or are prompt context); ids[read:] are held back.
        self._ids: list[int] = context
        self._read_offset = len(context)
        self._prefix_text = self._decode(context) if context else ""
        self._parts: list[str] = []
        self._num_tokens = 0

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)

    def step(self, token_id: int) -> str:
        """Add one generated id; return the text it completes ("" while a character is incomplete)."""
        self._ids.append(int(token_id))
        self._num_tokens += 1
        window_text = self._decode(self._ids)
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""  # a skipped special token, or a character still split across tokens
        return self._emit(window_text)

    def flush(self) -> str:
        """At the end of a sequence: the held-back text, even if it ends in an incomplete character."""
        window_text = self._decode(self._ids)
        if len(window_text) <= len(self._prefix_text):
            return ""
        return self._emit(window_text)

    def _emit(self, window_text: str) -> str:
        delta = window_text[len(self._prefix_text) :]
        # The ids just emitted become the context of the next window; older ones are dropped.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._parts.append(delta)
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._parts)

    @property
    def num_tokens(self) -> int:
        """How many ids ``step`` has been given."""
        return self._num_tokens
