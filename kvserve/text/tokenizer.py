"""Text -> token ids for the engine: encoding, chat templates, and the model's special tokens.

``Tokenizer`` wraps the Hugging Face tokenizer that ``kvserve.model.loader`` built and turns its
failure modes into ``InvalidArgumentError``; ``check_unicode`` refuses text no tokenizer can take.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvserve.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvserve.model.config import ModelConfig
    from kvserve.model.loader import LoadedModel

CHAT_ROLES = ("system", "user", "assistant", "tool")


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

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Render ``messages`` (and ``tools``, OpenAI's function definitions, when given) with the model's
        chat template and tokenize, as HF does."""
        if not self.has_chat_template:
            raise InvalidArgumentError(
                "this model has no chat template; use the completions endpoint with a plain prompt",
                param="messages",
            )
        _check_messages(messages)
        import jinja2

        extra = {"tools": tools} if tools else {}
        try:
            ids = self.hf.apply_chat_template(
                [dict(m) for m in messages],
                tokenize=True,
                add_generation_prompt=add_generation_prompt,
                return_dict=False,
                **extra,
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
