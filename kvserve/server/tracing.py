"""Request tracing (``--otlp-traces-endpoint``): one OpenTelemetry span per engine request.

Nothing here runs per step or per token. The engine stamps a request's stages on its own clock
(queued, first scheduled, tier blocks restored, first token; ``RequestTimeline``), sends them once,
with the request's first output, and the API process writes the whole span when the request
ends, with those times as event timestamps. The span's parent is the client's W3C
``traceparent`` header, when it sent one. Attributes follow OpenTelemetry's GenAI semantic
conventions where one fits (``gen_ai.*``); the rest are ``kvserve.*``. Spans go out over
OTLP/HTTP (protobuf) in batches, from the SDK's own thread.

Without the flag no tracer exists and this module is not imported by the request path; the
OpenTelemetry packages are an extra (``pip install kvserve[tracing]``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvserve.engine.messages import RequestDelta, RequestTimeline
from kvserve.engine.request import SamplingParams
from kvserve.errors import InvalidArgumentError
from kvserve.text.output import RequestOutput

SPAN_NAME = "llm_request"
TRACE_HEADERS = ("traceparent", "tracestate")


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of ``endpoint``: a collector's base URL gets the standard /v1/traces path."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InvalidArgumentError(f"--otlp-traces-endpoint must be an http(s):// URL (OTLP over HTTP), got "
                                   f"{endpoint!r}", param="otlp_traces_endpoint")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


@dataclass
class RequestTrace:
    """What one request's span is made of, gathered as its outputs arrive; written once, at its end."""

    tracer: RequestTracer
    request_id: str
    attributes: dict[str, Any]
    parent: dict[str, str]  # the client's traceparent / tracestate headers
    arrival: float  # time.monotonic() when the API process took the request
    timeline: RequestTimeline | None = None
    last_step_end: float | None = None  # the step that produced the latest tokens
    ended: bool = field(default=False, repr=False)

    def on_delta(self, step_end: float, delta: RequestDelta) -> None:
        if delta.timeline is not None:
            self.timeline = delta.timeline
        if delta.new_token_ids:
            self.last_step_end = step_end

    def finish(self, out: RequestOutput) -> None:
        self._end(out, None)

    def fail(self, error: str, out: RequestOutput | None = None) -> None:
        """End the span with an error status: the request was aborted or failed (``error`` says which)."""
        self._end(out, error)

    def _end(self, out: RequestOutput | None, error: str | None) -> None:
        if not self.ended:
            self.ended = True
            self.tracer.export(self, out, error, time.monotonic())


class RequestTracer:
    """Writes ``RequestTrace``s as spans through an OpenTelemetry span exporter (OTLP/HTTP unless given)."""

    def __init__(self, exporter: Any, *, batch: bool = True, service_name: str = "kvserve"):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
        self._provider = TracerProvider(resource=Resource.create(attrs))
        self._provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("kvserve")
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def otlp(cls, endpoint: str) -> RequestTracer:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return cls(OTLPSpanExporter(endpoint=traces_url(endpoint)))

    def begin(self, request_id: str, arrival: float, headers: Mapping[str, str] | None, *, model: str,
              operation: str, params: SamplingParams) -> RequestTrace:
        """The trace of one engine request (nothing is sent before it ends)."""
        parent = {h: headers[h] for h in TRACE_HEADERS if headers is not None and h in headers}
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "kvserve",
            "gen_ai.request.model": model,
            "gen_ai.response.model": model,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "kvserve.request.id": request_id,
        }
        if params.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = params.max_tokens
        if params.top_k:
            attrs["gen_ai.request.top_k"] = params.top_k
        if params.seed is not None:
            attrs["gen_ai.request.seed"] = params.seed
        return RequestTrace(self, request_id, attrs, parent, arrival)

    def export(self, trace: RequestTrace, out: RequestOutput | None, error: str | None, now: float) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        offset_ns = time.time_ns() - time.monotonic_ns()  # monotonic seconds -> Unix nanoseconds

        def ns(t: float) -> int:
            return int(t * 1e9) + offset_ns

        attrs = dict(trace.attributes)
        if out is not None:
            attrs["gen_ai.usage.input_tokens"] = out.num_prompt_tokens
            attrs["gen_ai.usage.output_tokens"] = len(out.token_ids)
            attrs["gen_ai.usage.cache_read.input_tokens"] = out.num_cached_tokens
            if out.finish_reason:
                attrs["gen_ai.response.finish_reasons"] = [out.finish_reason]
        if error is not None:
            attrs["error.type"] = error
        span = self._tracer.start_span(SPAN_NAME, context=self._propagator.extract(trace.parent), kind=SpanKind.SERVER,
                                       attributes=attrs, start_time=ns(trace.arrival))
        tl = trace.timeline
        if tl is not None:
            span.add_event("queued", timestamp=ns(tl.queued))
            if tl.scheduled is not None:
                span.add_event("scheduled", {"kvserve.queue_time_s": tl.scheduled - tl.queued},
                               timestamp=ns(tl.scheduled))
                for tier, blocks in tl.restored_blocks.items():
                    span.add_event("tier_restore", {"kvserve.kv.tier": tier, "kvserve.kv.blocks": blocks},
                                   timestamp=ns(tl.scheduled))
            if tl.first_token is not None:
                span.add_event("first_token", timestamp=ns(tl.first_token))
                span.set_attribute("gen_ai.response.time_to_first_chunk", tl.first_token - trace.arrival)
        if error is None and trace.last_step_end is not None:
            span.add_event("decode_done", timestamp=ns(trace.last_step_end))
        span.set_status(Status(StatusCode.ERROR, error) if error is not None else Status(StatusCode.OK))
        span.end(end_time=ns(max(now, trace.arrival)))

    def shutdown(self) -> None:
        """Send what is queued and stop the exporter."""
        self._provider.shutdown()
