"""Text -> token ids for the engine: encoding, chat templates, and the model's special tokens.

``Tokenizer`` wraps the Hugging Face tokenizer that ``kvserve.model.loader`` built and turns its
failure modes into ``InvalidArgumentError``; ``check_unicode`` refuses text no tokenizer can take;
``bad_words_token_ids`` turns vLLM's ``bad_words`` into the token sequences the sampler bans.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvserve.engine.request import check_bad_words
from kvserve.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvserve.model.config import ModelConfig
    from kvserve.model.loader import LoadedModel

CHAT_ROLES = ("system", "user", "assistant", "tool")  # the usual roles; templates may take others


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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, with BOS only if the tokenizer itself adds it (HF's default) and
        ``add_special_tokens``."""
        if not isinstance(text, str):
            raise InvalidArgumentError(f"expected text as a string, got {type(text).__name__}", param="prompt")
        check_unicode(text, "the prompt", "prompt")
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            tools: list[dict[str, Any]] | None = None,
                            chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Render ``messages`` (and ``tools``, OpenAI's function definitions, when given) with the model's
        chat template and tokenize, as HF does. Any role is passed to the template (which may refuse
        it); ``continue_final_message`` leaves the last message open, for the model to continue (it
        must be an assistant's); ``chat_template_kwargs`` are more variables for the template (vLLM's
        request field: ``{"enable_thinking": false}``), those it does not read are harmless."""
        if not self.has_chat_template:
            raise InvalidArgumentError(
                "this model has no chat template; use the completions endpoint with a plain prompt",
                param="messages",
            )
        _check_messages(messages)
        if continue_final_message and messages[-1].get("role") != "assistant":
            raise InvalidArgumentError("continue_final_message needs the last message to be the assistant's",
                                       param="continue_final_message")
        import jinja2

        extra = {**self._template_kwargs(chat_template_kwargs), **({"tools": tools} if tools else {})}
        try:
            ids = self.hf.apply_chat_template(
                [dict(m) for m in messages],
                tokenize=True,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                return_dict=False,
                **extra,
            )
        except jinja2.TemplateError as e:  # includes the templates' raise_exception(...)
            raise InvalidArgumentError(f"the chat template rejected the messages: {e}", param="messages") from e
        except ValueError as e:  # transformers': e.g. a final message the template does not render
            if not continue_final_message:
                raise
            raise InvalidArgumentError(f"continue_final_message: {e}", param="continue_final_message") from e
        return [int(i) for i in ids]

    def _template_kwargs(self, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """``chat_template_kwargs``, checked: a name of apply_chat_template's own arguments (``tokenize``,
        ``chat_template``, ...) or of what the template gets anyway (``messages``) would change how the
        prompt is made, not just what the template reads: a 400."""
        if not kwargs:
            return {}
        params = inspect.signature(self.hf.apply_chat_template).parameters
        reserved = {"messages", *(n for n, p in params.items() if p.kind is not p.VAR_KEYWORD)}
        taken = sorted(reserved.intersection(kwargs))
        if taken:
            raise InvalidArgumentError(f"chat_template_kwargs cannot set {', '.join(taken)}",
                                       param="chat_template_kwargs")
        check_unicode(json.dumps(kwargs, ensure_ascii=False), "chat_template_kwargs", "chat_template_kwargs")
        return dict(kwargs)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidArgumentError("messages must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidArgumentError(f"messages[{i}] must be an object", param="messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:  # any role (the template decides), as vLLM does
            raise InvalidArgumentError(f"messages[{i}].role must be a non-empty string, got {role!r}",
                                       param="messages")
        if not isinstance(message.get("content"), str):
            raise InvalidArgumentError(f"messages[{i}].content must be a string", param="messages")
        for key in ("role", "content", "name"):
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


def bad_words_token_ids(words: list[str], tokenizer: Tokenizer) -> list[list[int]]:
    """The token sequences of vLLM's ``bad_words``: each word as written and, when that makes another
    first token and as many tokens, after a space (the form a word takes inside a text)."""
    check_bad_words(words)
    seqs: list[list[int]] = []
    for word in words:
        check_unicode(word, "a bad word", "bad_words")
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        seqs.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if plain and spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            seqs.append(spaced)
    return seqs
