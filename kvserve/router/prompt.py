"""A request's prompt token ids as the replicas will compute them (``PromptTokenizer``), for predicting cache hits.

The router loads the tokenizer of the model its replicas serve (``--model``, the embedded model by
default; no weights are read) and tokenizes each completion or chat request once, on one thread of
its own (a Hugging Face tokenizer is not safe to share between threads), exactly as the server
does: completion prompts with ``Tokenizer.encode``, chat messages (and tools) through the chat
template with the server's own request model and tool handling, and the request's
``chat_template_kwargs``. A request the router cannot tokenize (malformed, or too long to be worth
it) is still forwarded, unpredicted: the replica answers it, with its error when it is one.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvserve.text.tokenizer import Tokenizer

log = logging.getLogger("kvserve.router")

MAX_PROMPT_CHARS = 1 << 18  # longer prompts are routed on load alone rather than tokenized here


class PromptTokenizer:
    def __init__(self, tokenizer: Tokenizer, tool_call_parser: str = "auto"):
        from kvserve.server.tools import ToolCalling

        self.tokenizer = tokenizer
        self.tools = ToolCalling(tool_call_parser, tokenizer)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-router-tokenize")

    @classmethod
    def load(cls, model: str | None, tool_call_parser: str = "auto") -> PromptTokenizer:
        """The tokenizer of ``model`` (a folder or .gguf file; None: the embedded model)."""
        from kvserve.model.loader import load_tokenizer, resolve_model_path

        return cls(Tokenizer(load_tokenizer(resolve_model_path(model))), tool_call_parser)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def prompts(self, route: str, body: Any) -> list[list[int]] | None:
        """The token ids of each prompt of a ``completions`` or ``chat`` request body; None if unknown."""
        if not isinstance(body, dict):
            return None
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self.tokenize, route, body)
        except Exception as e:  # noqa: BLE001 - the replica will say what is wrong with it
            log.debug("not predicting a %s request: %s", route, e)
            return None

    def tokenize(self, route: str, body: dict[str, Any]) -> list[list[int]] | None:
        if route == "completions":
            return self._completion(body.get("prompt"))
        if route == "chat":
            return self._chat(body)
        return None

    def _completion(self, prompt: Any) -> list[list[int]] | None:
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt)] if len(prompt) <= MAX_PROMPT_CHARS else None
        if not isinstance(prompt, list) or not prompt:
            return None
        if all(isinstance(t, int) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            if sum(map(len, prompt)) > MAX_PROMPT_CHARS:
                return None
            return [self.tokenizer.encode(p) for p in prompt]
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            return [list(p) for p in prompt]
        return None

    def _chat(self, body: dict[str, Any]) -> list[list[int]] | None:
        from kvserve.server import protocol as P

        req = P.ChatCompletionRequest.model_validate(body)
        messages, tools = self.tools.template_inputs(req.template_messages(), self.tools.plan(req))
        kwargs = req.chat_template_kwargs
        if (sum(len(m.get("content") or "") for m in messages) + len(str(tools or "")) + len(str(kwargs or ""))
                > MAX_PROMPT_CHARS):
            return None
        return [self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                   continue_final_message=req.continue_final_message, tools=tools,
                                                   chat_template_kwargs=kwargs)]


def body_model(payload: Any) -> str | None:
    """A request body's ``model`` (None when it names none): a LoRA adapter's requests go where it is loaded."""
    model = payload.get("model") if isinstance(payload, dict) else None
    return model if isinstance(model, str) else None
