"""The HTTP server: the FastAPI app (OpenAI routes, health, metrics), error mapping, and ``serve``.

A request's path: the guard middleware (API key, body size) → FastAPI parses the body into a
``kvserve.server.protocol`` model → the route tokenizes, validates, and adds one engine request
per prompt and choice through ``AsyncEngineClient`` → outputs come back as RequestOutputs and are
rendered as one JSON response or as server-sent events. Every error a client can cause ends in
``error_response``, the one place that picks an HTTP status and writes OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import kvserve
from kvserve.text.output import RequestOutput
from kvserve.engine.process import AsyncEngineClient, RequestStream
from kvserve.engine.request import TokenLogprobs
from kvserve.errors import (
    AuthenticationError,
    EngineDeadError,
    InvalidArgumentError,
    KVServeError,
    RequestTooLargeError,
    ServerBusyError,
)
from kvserve.server import protocol as P
from kvserve.server.metrics import ServerMetrics

log = logging.getLogger("kvserve.server")

DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # a full 128K-token prompt as text is ~0.5-3 MB of JSON
MAX_CHOICES = 1024  # engine requests one HTTP request may create (prompts x n)
T = TypeVar("T")


@dataclass
class ServerConfig:
    served_model_names: list[str] = field(default_factory=list)  # default: the model's own name
    api_key: str | None = None  # when set, /v1 routes need "Authorization: Bearer <key>"
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # Logs hold no prompt or answer text unless this is set (a debugging aid): then each request's
    # prompt (its first ``max_log_len`` characters) and sampling parameters are logged at INFO.
    log_requests: bool = False
    max_log_len: int = 200


# --------------------------------------------------------------------------- errors

# (error class, HTTP status, OpenAI error type); the first match wins.
_ERROR_STATUS: list[tuple[type[BaseException], int, str]] = [
    (InvalidArgumentError, 400, "invalid_request_error"),
    (AuthenticationError, 401, "authentication_error"),
    (RequestTooLargeError, 413, "invalid_request_error"),
    (ServerBusyError, 429, "rate_limit_error"),
    (EngineDeadError, 503, "service_unavailable_error"),
    (KVServeError, 400, "invalid_request_error"),
]


def error_body(exc: BaseException) -> tuple[int, P.ErrorResponse]:
    """The HTTP status and OpenAI error body of an exception: the one mapping the server uses."""
    param = code = None
    if isinstance(exc, RequestValidationError):  # pydantic: a 400, as OpenAI answers, not FastAPI's 422
        status, kind, message, param = 400, "invalid_request_error", *_describe_validation(exc)
    elif isinstance(exc, StarletteHTTPException):  # routing: 404, 405
        status = exc.status_code
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        message = str(exc.detail)
    else:
        for cls, status, kind in _ERROR_STATUS:
            if isinstance(exc, cls):
                message = str(exc)
                param = getattr(exc, "param", None)
                code = getattr(exc, "code", None)
                break
        else:
            status, kind, message = 500, "internal_error", "internal server error"
    if code is None and isinstance(exc, AuthenticationError):
        code = "invalid_api_key"
    return status, P.ErrorResponse(error=P.ErrorInfo(message=message, type=kind, param=param, code=code))


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_body(exc)
    if status >= 500 and not isinstance(exc, EngineDeadError):
        log.error("internal error", exc_info=exc)
    return JSONResponse(body.model_dump(), status_code=status)


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    parts = []
    for e in errors[:3]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}")
        else:
            parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
    first = [str(x) for x in errors[0].get("loc", ()) if x != "body"]
    param = first[0] if first and errors[0].get("type") != "json_invalid" else None
    return "; ".join(parts), param


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


# --------------------------------------------------------------------------- middleware


class GuardMiddleware:
    """Checks the API key before anything else, then reads the body within the size limit.

    The body is read here, whole, and replayed to the app: the limit holds whether or not the
    client sent Content-Length. Over the limit, the rest of the body is drained (up to a bound)
    so that the client reads its 413 instead of a reset connection.
    """

    DRAIN_FACTOR = 8

    def __init__(self, app: ASGIApp, api_key: str | None, max_bytes: int):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key is not None and scope["path"].startswith("/v1") and not self._authorized(scope):
            await error_response(AuthenticationError("missing or wrong API key"))(scope, receive, send)
            return
        too_large = RequestTooLargeError(f"the request body is over the limit of {self.max_bytes} bytes")
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            if not length.isdigit():
                await error_response(InvalidArgumentError("bad Content-Length"))(scope, receive, send)
            else:
                await error_response(too_large)(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size <= self.max_bytes:
                chunks.append(message.get("body", b""))
            if not message.get("more_body", False) or size > self.max_bytes * self.DRAIN_FACTOR:
                break
        if size > self.max_bytes:
            await error_response(too_large)(scope, receive, send)
            return
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect

        await self.app(scope, replay, send)

    def _authorized(self, scope: Scope) -> bool:
        value = _header(scope, b"authorization") or ""
        scheme, _, token = value.partition(" ")
        assert self.api_key is not None
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


# --------------------------------------------------------------------------- helpers


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``; if the client goes away first, cancel it and raise ClientDisconnected."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise ClientDisconnected()
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several engine requests (n choices, several prompts) as they come, tagged by index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator, so aborts run at once on a disconnect."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


# Characters JSON may leave raw that line-splitting clients (str.splitlines, httpx's aiter_lines)
# take for line ends, cutting an event in two: escape them. A sampled token can be one of these.
_LINE_BREAKERS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(model: Any) -> str:
    return f"data: {model.model_dump_json().translate(_LINE_BREAKERS)}\n\n"


def _usage(prompt_lens: list[int], cached: list[int], outs: dict[int, RequestOutput]) -> P.Usage:
    prompt = sum(prompt_lens)
    completion = sum(len(o.token_ids) for o in outs.values())
    usage = P.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                    prompt_tokens_details=P.PromptTokensDetails(cached_tokens=sum(cached)))
    drafted = sum(o.num_draft_tokens for o in outs.values())
    if drafted:
        accepted = sum(o.num_accepted_tokens for o in outs.values())
        verifies = sum(o.num_verify_steps for o in outs.values())
        usage.completion_tokens_details = P.CompletionTokensDetails(accepted_prediction_tokens=accepted,
                                                                    rejected_prediction_tokens=drafted - accepted)
        usage.speculative = P.SpeculativeUsage(draft_tokens=drafted, accepted_tokens=accepted, verify_steps=verifies,
                                               mean_accepted_length=round(1 + accepted / verifies, 4))
    return usage


# --------------------------------------------------------------------------- the app


class _Server:
    """The routes' shared state: the engine client, names, metrics, the tokenizer."""

    def __init__(self, client: AsyncEngineClient, config: ServerConfig):
        self.client = client
        self.config = config
        self.names = list(config.served_model_names) or [client.model_name]
        self.metrics = ServerMetrics(client, self.names[0])
        client.observer = self.metrics
        self.tokenizer = client.tokenizer
        # A token never covers more characters of text than its vocabulary entry has (byte-level
        # entries spell bytes, and a character is at least one), so a text longer than this cannot
        # fit the context window: refused without tokenizing it (8 MB of text takes ~10 s here).
        self.max_prompt_chars = client.max_model_len * max(map(len, self.tokenizer.hf.get_vocab()))
        # Tokenizing runs on its own thread, so a long prompt does not stall other streams; one
        # thread, because a Hugging Face tokenizer is not safe to call from several at once.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-tokenize")

    def check_model(self, model: str | None) -> str:
        if model is not None and model not in self.names:
            raise InvalidArgumentError(f"the model {model!r} does not exist; this server serves "
                                       f"{', '.join(map(repr, self.names))}", param="model", code="model_not_found")
        return model or self.names[0]

    def check_prompt_chars(self, num_chars: int) -> None:
        if num_chars > self.max_prompt_chars:
            raise InvalidArgumentError(
                f"the prompt has {num_chars} characters: more than this model's context window of "
                f"{self.client.max_model_len} tokens can hold", param="prompt", code="context_length_exceeded")

    async def encode(self, texts: list[str]) -> list[list[int]]:
        for text in texts:
            self.check_prompt_chars(len(text))
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, lambda: [self.tokenizer.encode(t) for t in texts])

    async def render_chat(self, body: P.ChatCompletionRequest) -> list[int]:
        messages = body.template_messages()
        self.check_prompt_chars(sum(len(m["content"]) for m in messages))
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, lambda: self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt))

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    def log_request(self, request_id: str, prompt: list[int], params: Any) -> None:
        text = self.tokenizer.decode(prompt[: self.config.max_log_len], skip_special_tokens=False)
        log.info("request %s: %d prompt tokens %r, %s", request_id, len(prompt), text[: self.config.max_log_len],
                 params)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- shared request plumbing ------------------------------------------------------------
    def start(self, prompts: list[list[int]], body: P._SamplingRequest,
              params_for: Callable[[int], Any]) -> list[RequestStream]:
        """Validate everything, then add prompts x n engine requests (choice k = prompt * n + i)."""
        check_choices(len(prompts) * body.n)
        params = [params_for(i) for i in range(body.n)]
        for p in prompts:
            self.client.validate_prompt(p)
        self.client.check_capacity(len(prompts) * body.n)
        streams: list[RequestStream] = []
        try:
            for p in prompts:
                for i in range(body.n):
                    streams.append(self.client.add_request(p, params[i]))
                    if self.config.log_requests:
                        self.log_request(streams[-1].request_id, p, params[i])
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    async def respond(self, request: Request, streams: list[RequestStream], stream: bool,
                      render: Callable[[dict[int, RequestOutput]], Any],
                      render_events: Callable[[AsyncIterator[tuple[int, RequestOutput]], tuple[int, RequestOutput]],
                                              AsyncIterator[str]]) -> Response:
        events = _merge(streams)
        handed_over = False  # to the streaming response, which then owns the cleanup
        try:
            if not stream:
                async def collect() -> dict[int, RequestOutput]:
                    finals: dict[int, RequestOutput] = {}
                    async for i, out in events:
                        finals[i] = out
                    return finals

                return JSONResponse(render(await _unless_disconnected(request, collect())).model_dump())
            # Wait for the first output before sending headers: an error the engine reports for
            # the request (or a dead engine) still gets its proper status this way.
            first = await _unless_disconnected(request, anext(events))
            handed_over = True
            return _SSEResponse(self._sse_body(streams, events, first, render_events),
                                media_type="text/event-stream")
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; the requests are aborted below
        finally:
            if not handed_over:
                await events.aclose()
                for s in streams:
                    s.abort()

    async def _sse_body(self, streams: list[RequestStream], events: AsyncIterator[tuple[int, RequestOutput]],
                        first: tuple[int, RequestOutput],
                        render_events: Callable[..., AsyncIterator[str]]) -> AsyncIterator[str]:
        try:
            async for chunk in render_events(events, first):
                yield chunk
        except KVServeError as e:  # e.g. the engine died mid-stream: say so in the stream
            yield _sse(error_body(e)[1])
        finally:
            # runs on normal ends, errors and disconnects alike (see _SSEResponse)
            await events.aclose()  # type: ignore[attr-defined]
            for s in streams:
                s.abort()
        yield "data: [DONE]\n\n"


def create_app(client: AsyncEngineClient, config: ServerConfig | None = None, *, own_client: bool = True) -> FastAPI:
    """The FastAPI app over a started engine client. With ``own_client``, the app's shutdown stops it."""
    config = config or ServerConfig()
    server = _Server(client, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.attach()
        try:
            yield
        finally:
            server.close()
            if own_client:
                client.shutdown()

    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan)
    app.state.server = server
    app.add_middleware(GuardMiddleware, api_key=config.api_key, max_bytes=config.max_request_bytes)

    async def handle(_request: Request, exc: Exception) -> Response:
        return error_response(exc)

    for exc_class in (KVServeError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(exc_class, handle)

    @app.get("/health")
    async def health() -> dict[str, str]:
        if not client.is_alive:
            raise EngineDeadError("the engine process is not running")
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kvserve.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> P.ModelList:
        created = P.now_s()
        return P.ModelList(data=[P.ModelCard(id=name, created=created, root=client.model_name,
                                             max_model_len=client.max_model_len) for name in server.names])

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        model = server.check_model(body.model)
        prompts = await _completion_prompts(body.prompt, server)
        streams = server.start(prompts, body, body.sampling_params)
        rid, created = P.new_id("cmpl"), P.now_s()
        want_logprobs = body.logprobs is not None
        prompt_lens = [len(p) for p in prompts]

        def cached(outs: dict[int, RequestOutput]) -> list[int]:  # once per prompt, from its first choice
            return [outs[k].num_cached_tokens for k in range(0, len(streams), body.n) if k in outs]

        def render(outs: dict[int, RequestOutput]) -> P.CompletionResponse:
            choices = []
            for k in range(len(streams)):
                out = outs[k]
                lp = _completion_logprobs(server, out.logprobs, 0) if want_logprobs else None
                choices.append(P.CompletionChoice(index=k, text=out.text, logprobs=lp,
                                                  finish_reason=out.finish_reason, stop_reason=out.stop_reason))
            return P.CompletionResponse(id=rid, created=created, model=model, choices=choices,
                                        usage=_usage(prompt_lens, cached(outs), outs))

        async def render_events(events: AsyncIterator[tuple[int, RequestOutput]],
                                first: tuple[int, RequestOutput]) -> AsyncIterator[str]:
            last: dict[int, RequestOutput] = {}
            offsets: dict[int, int] = {}
            item: tuple[int, RequestOutput] | None = first
            while item is not None:
                k, out = item
                last[k] = out
                lp = None
                if want_logprobs:
                    new = out.logprobs[len(out.logprobs) - len(out.delta_token_ids):] if out.delta_token_ids else []
                    lp = _completion_logprobs(server, new, offsets.get(k, 0))
                    offsets[k] = offsets.get(k, 0) + sum(len(t) for t in lp.tokens)
                if out.delta_text or out.finished or lp is not None:
                    # model_construct: per-token path, values of our own making need no validation
                    choice = P.CompletionChoice.model_construct(
                        index=k, text=out.delta_text, logprobs=lp,
                        finish_reason=out.finish_reason if out.finished else None,
                        stop_reason=out.stop_reason if out.finished else None)
                    yield _sse(P.CompletionResponse.model_construct(id=rid, created=created, model=model,
                                                                    choices=[choice]))
                item = await anext(events, None)  # type: ignore[arg-type]
            if body.include_usage:
                yield _sse(P.CompletionResponse(id=rid, created=created, model=model, choices=[],
                                                usage=_usage(prompt_lens, cached(last), last)))

        return await server.respond(request, streams, body.stream, render, render_events)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request) -> Response:
        model = server.check_model(body.model)
        prompt = await server.render_chat(body)
        streams = server.start([prompt], body, body.sampling_params)
        rid, created = P.new_id("chatcmpl"), P.now_s()
        top_n = (body.top_logprobs or 0) if body.logprobs else None

        def render(outs: dict[int, RequestOutput]) -> P.ChatCompletionResponse:
            choices = []
            for k in range(len(streams)):
                out = outs[k]
                lp = _chat_logprobs(server, out.logprobs, top_n) if top_n is not None else None
                choices.append(P.ChatChoice(index=k, message=P.ChatMessageOut(content=out.text), logprobs=lp,
                                            finish_reason=out.finish_reason, stop_reason=out.stop_reason))
            cached = [outs[0].num_cached_tokens] if 0 in outs else []
            return P.ChatCompletionResponse(id=rid, created=created, model=model, choices=choices,
                                            usage=_usage([len(prompt)], cached, outs))

        def chunk(choices: list[P.ChatStreamChoice], usage: P.Usage | None = None) -> str:
            return _sse(P.ChatCompletionChunk.model_construct(id=rid, created=created, model=model, choices=choices,
                                                              usage=usage))

        async def render_events(events: AsyncIterator[tuple[int, RequestOutput]],
                                first: tuple[int, RequestOutput]) -> AsyncIterator[str]:
            for k in range(len(streams)):
                yield chunk([P.ChatStreamChoice(index=k, delta=P.DeltaMessage(role="assistant", content=""))])
            last: dict[int, RequestOutput] = {}
            item: tuple[int, RequestOutput] | None = first
            while item is not None:
                k, out = item
                last[k] = out
                lp = None
                if top_n is not None:
                    new = out.logprobs[len(out.logprobs) - len(out.delta_token_ids):] if out.delta_token_ids else []
                    lp = _chat_logprobs(server, new, top_n)
                if out.delta_text or out.finished or lp is not None:
                    yield chunk([P.ChatStreamChoice.model_construct(
                        index=k, delta=P.DeltaMessage.model_construct(content=out.delta_text or None), logprobs=lp,
                        finish_reason=out.finish_reason if out.finished else None,
                        stop_reason=out.stop_reason if out.finished else None)])
                item = await anext(events, None)  # type: ignore[arg-type]
            if body.include_usage:
                cached = [last[0].num_cached_tokens] if 0 in last else []
                yield chunk([], usage=_usage([len(prompt)], cached, last))

        return await server.respond(request, streams, body.stream, render, render_events)

    return app


def check_choices(num_requests: int) -> None:
    if num_requests > MAX_CHOICES:
        raise InvalidArgumentError(f"at most {MAX_CHOICES} prompts x n per request", param="prompt")


async def _completion_prompts(prompt: Any, server: _Server) -> list[list[int]]:
    if isinstance(prompt, str):
        return await server.encode([prompt])
    if not prompt or isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        check_choices(len(prompt))  # before tokenizing them all
        return await server.encode(prompt)
    return [list(p) for p in prompt]


MIN_LOGPROB = -9999.0  # JSON has no -inf: what a token that cannot be sampled (a grammar masks it) shows, as in vLLM


def _logprob(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB  # -inf, and NaN too


def _completion_logprobs(server: _Server, logprobs: list[TokenLogprobs], offset: int) -> P.CompletionLogprobs:
    out = P.CompletionLogprobs()
    for lp in logprobs:
        text = server.token_text(lp.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(_logprob(lp.logprob))
        out.text_offset.append(offset)
        offset += len(text)
        out.top_logprobs.append({server.token_text(t): _logprob(v) for t, v in lp.top} if lp.top else None)
    return out


def _chat_logprobs(server: _Server, logprobs: list[TokenLogprobs], top_n: int | None) -> P.ChatLogprobs:
    content = []
    for lp in logprobs:
        text = server.token_text(lp.token_id)
        top = [P.TopLogprob(token=(t := server.token_text(i)), logprob=_logprob(v), bytes=list(t.encode()))
               for i, v in lp.top[: top_n or 0]]
        content.append(P.TokenLogprob(token=text, logprob=_logprob(lp.logprob), bytes=list(text.encode()),
                                      top_logprobs=top))
    return P.ChatLogprobs(content=content)


# --------------------------------------------------------------------------- kvserve serve


ENGINE_WATCH_INTERVAL_S = 0.5


def serve(client_factory: Callable[[], AsyncEngineClient], config: ServerConfig, host: str, port: int, *,
          graceful_shutdown_timeout: float = 30.0, log_level: str = "info") -> None:
    """Bind, start the engine, and serve until SIGINT/SIGTERM.

    SIGTERM (and a first Ctrl-C) stop accepting connections, let requests in flight finish
    (for at most ``graceful_shutdown_timeout`` seconds), stop the engine, and return. If the engine
    process dies, the requests in it get an error, /health says 503, and the server stops and
    raises EngineDeadError (the CLI exits non-zero), so that a supervisor restarts it.
    """
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))  # before loading the model: a busy port fails fast
    except OSError as e:
        sock.close()
        raise InvalidArgumentError(f"cannot listen on {host}:{port}: {e.strerror}", param="port") from e
    client = client_factory()
    died = threading.Event()
    try:
        app = create_app(client, config)
        uv_config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=graceful_shutdown_timeout,
                                   timeout_keep_alive=5)
        server = uvicorn.Server(uv_config)

        def watch_engine() -> None:
            while not server.should_exit:
                if not client.is_alive:
                    died.set()
                    log.error("the engine process died: stopping the server (non-zero exit) so that a supervisor "
                              "restarts it")
                    server.should_exit = True
                    return
                died.wait(ENGINE_WATCH_INTERVAL_S)

        threading.Thread(target=watch_engine, name="engine-watch", daemon=True).start()
        names = ", ".join(app.state.server.names)
        log.info("serving %s on http://%s:%d (OpenAI API under /v1)", names, host, port)
        # uvicorn re-raises the signal that stopped it once it is done; a no-op handler for
        # SIGTERM turns that into a normal return, so a graceful stop exits with status 0.
        previous = signal.signal(signal.SIGTERM, lambda *_: None)
        try:
            server.run(sockets=[sock])
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        sock.close()
        if client.is_alive:
            client.shutdown()
    if died.is_set():
        raise EngineDeadError("the engine process died; the server stopped")
