"""The routes' shared state (``ServerState``): the engine client, model names, metrics, tokenizing,
and starting a request's engine requests; and ``get_state``, how a route reaches it.

The app keeps one ``ServerState`` in ``app.state.server``. It uses the engine client through its
public methods only (add_request, check_capacity, validate_prompt, model_name, max_model_len,
tokenizer) and installs the metrics as its observer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request

from kvserve.config import ServerConfig
from kvserve.errors import InvalidArgumentError, NotFoundError
from kvserve.server import protocol as P
from kvserve.server.engine_client import EngineClient
from kvserve.server.engine_view import EngineView
from kvserve.server.lora_metrics import LoRACollector
from kvserve.server.metrics import ServerMetrics
from kvserve.server.request_stream import RequestStream
from kvserve.text.reasoning import ReasoningSplitter
from kvserve.text.tokenizer import bad_words_token_ids
from kvserve.server.tools import ToolCalling, ToolPlan

log = logging.getLogger("kvserve.server")

MAX_CHOICES = 1024  # engine requests one HTTP request may create (prompts x n)
T = TypeVar("T")


def check_choices(num_requests: int) -> None:
    if num_requests > MAX_CHOICES:
        raise InvalidArgumentError(f"at most {MAX_CHOICES} prompts x n per request", param="prompt")


class ServerState:
    """The routes' shared state: the engine client, names, metrics, the tokenizer."""

    def __init__(self, client: EngineClient, config: ServerConfig):
        self.client = client
        self.config = config
        self.names = list(config.served_model_names) or [client.model_name]
        self.metrics = ServerMetrics(client, self.names[0])
        client.observer = self.metrics
        if getattr(client, "lora_adapters", None) is not None:
            self.metrics.registry.register(LoRACollector(client))
        self.tokenizer = client.tokenizer
        # A token never covers more characters of text than its vocabulary entry has (byte-level
        # entries spell bytes, and a character is at least one), so a text longer than this cannot
        # fit the context window: refused without tokenizing it (8 MB of text takes ~10 s here).
        self.max_prompt_chars = client.max_model_len * max(map(len, self.tokenizer.hf.get_vocab()))
        # Tokenizing runs on its own thread, so a long prompt does not stall other streams; one
        # thread, because a Hugging Face tokenizer is not safe to call from several at once.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-tokenize")
        self.tools = ToolCalling(config.tool_call_parser, self.tokenizer)  # function calling
        self.tracer: Any = None  # a kvserve.server.tracing.RequestTracer with --otlp-traces-endpoint
        if config.otlp_traces_endpoint:
            from kvserve.server.tracing import RequestTracer

            self.tracer = RequestTracer.otlp(config.otlp_traces_endpoint)
        self.engine_view = EngineView(client, self.names[0])  # the web page's live view (routes/ui.py)
        self.stopping = False  # set when the server stops: endless streams (the live view) end then

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        if self.tracer is not None:
            self.tracer.shutdown()

    @property
    def adapters(self) -> list[str]:
        """The LoRA adapters a request may name as its model (none unless --enable-lora)."""
        return list(getattr(self.client, "lora_adapters", None) or [])

    def check_model(self, model: str | None) -> str:
        if model is not None and model not in self.names and model not in self.adapters:  # a 404, as OpenAI answers
            raise NotFoundError(f"the model {model!r} does not exist; this server serves "
                                f"{', '.join(map(repr, self.names + self.adapters))}", param="model",
                                code="model_not_found")
        return model or self.names[0]

    def lora_of(self, model: str | None) -> str | None:
        """The LoRA adapter a (checked) model name picks; None for the base model."""
        return model if model is not None and model not in self.names else None

    async def prepare(self, body: P._SamplingRequest) -> None:
        """Check what a request asks across its fields, and tokenize its bad_words."""
        body.check()
        if body.bad_words:
            words = body.bad_words
            body._bad_words_token_ids = await self.in_tokenizer_thread(
                lambda: bad_words_token_ids(words, self.tokenizer))

    def check_prompt_chars(self, num_chars: int) -> None:
        if num_chars > self.max_prompt_chars:
            raise InvalidArgumentError(
                f"the prompt has {num_chars} characters: more than this model's context window of "
                f"{self.client.max_model_len} tokens can hold", param="prompt", code="context_length_exceeded")

    # -- tokenizing --------------------------------------------------------------------------
    async def in_tokenizer_thread(self, work: Callable[[], T]) -> T:
        """Run ``work`` (which uses the tokenizer) on the tokenizer's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, work)

    async def encode(self, texts: list[str]) -> list[list[int]]:
        for text in texts:
            self.check_prompt_chars(len(text))
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, lambda: [self.tokenizer.encode(t) for t in texts])

    async def completion_prompts(self, prompt: Any) -> list[list[int]]:
        """The token ids of a completion request's prompt: a text, a token list, or a list of either."""
        if isinstance(prompt, str):
            return await self.encode([prompt])
        if not prompt or isinstance(prompt[0], int):
            return [list(prompt)]
        if isinstance(prompt[0], str):
            check_choices(len(prompt))  # before tokenizing them all
            return await self.encode(prompt)
        return [list(p) for p in prompt]

    async def chat_prompt(self, body: P.ChatCompletionRequest, tools: ToolPlan | None = None) -> list[int]:
        """The token ids of a chat request's messages (and tools), through the model's chat template."""
        messages, template_tools = self.tools.template_inputs(body.template_messages(), tools)
        kwargs = body.chat_template_kwargs
        self.check_prompt_chars(sum(len(m["content"]) for m in messages) + len(str(template_tools or ""))
                                + len(str(kwargs or "")))
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, lambda: self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, tools=template_tools, chat_template_kwargs=kwargs))

    def reasoning_splitter(self, body: P.ChatCompletionRequest) -> ReasoningSplitter | None:
        """How the request's answers split into reasoning and content; None without --reasoning-parser."""
        name = self.config.reasoning_parser
        return None if name is None else ReasoningSplitter.of(name, body.chat_template_kwargs)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- starting engine requests ------------------------------------------------------------
    def start(self, prompts: list[list[int]], body: P._SamplingRequest, params_for: Callable[[int], Any], *,
              model: str | None = None, headers: Mapping[str, str] | None = None) -> list[RequestStream]:
        """Validate everything, then add prompts x n engine requests (choice k = prompt * n + i).
        With tracing on, each gets a trace, its parent the ``traceparent`` in ``headers``."""
        check_choices(len(prompts) * body.n)
        lora = self.lora_of(model)
        params = [params_for(i) for i in range(body.n)]
        for p in prompts:
            self.client.validate_prompt(p)
        self.client.check_capacity(len(prompts) * body.n)
        streams: list[RequestStream] = []
        try:
            for p in prompts:
                for i in range(body.n):
                    streams.append(self.client.add_request(p, params[i], validate=False,  # checked above
                                                           trace=self.tracer is not None, lora_name=lora))
                    if self.tracer is not None:
                        s = streams[-1]
                        s.trace = self.tracer.begin(
                            s.request_id, s.arrival_time, headers, model=model or self.names[0], params=params[i],
                            operation="chat" if isinstance(body, P.ChatCompletionRequest) else "text_completion")
                    if self.config.log_requests:
                        self.log_request(streams[-1].request_id, p, params[i])
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    def log_request(self, request_id: str, prompt: list[int], params: Any) -> None:
        text = self.tokenizer.decode(prompt[: self.config.max_log_len], skip_special_tokens=False)
        log.info("request %s: %d prompt tokens %r, %s", request_id, len(prompt), text[: self.config.max_log_len],
                 params)


def get_state(request: Request) -> ServerState:
    """The app's ServerState, for a route (as the ``State`` dependency)."""
    return request.app.state.server


State = Annotated[ServerState, Depends(get_state)]
