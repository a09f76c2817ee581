"""Spans of one request as its processes see them, and the W3C trace context that joins them.

The context travels inside the typed messages that already cross processes (`TraceContext` on
`GenerateRequest` and `HandoffNote`), never in a side channel: the ingress puts its request span's, the
scheduler replaces it with its placement span's before a worker sees the request, a prefill worker puts
its KV send span's into the handoff note.

Workers record their spans after the fact from the stage stamps they already keep per attempt
(`StageTimes`): nothing is recorded per token or per engine step.
"""

from __future__ import annotations

from typing import Iterable

from actors.protocol.messages import TraceContext


def context_of(trace: TraceContext | None):
    """The OpenTelemetry context that continues `trace` (an empty one when None: a new trace)."""
    from opentelemetry.context import Context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if trace is None:
        return Context()
    carrier = {"traceparent": trace.traceparent}
    if trace.tracestate:
        carrier["tracestate"] = trace.tracestate
    return TraceContextTextMapPropagator().extract(carrier)


def trace_of(span) -> TraceContext | None:
    """What a message carries so that its receiver continues `span` (None if the span is not recorded)."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
    if "traceparent" not in carrier:
        return None
    return TraceContext(carrier["traceparent"], carrier.get("tracestate", ""))


def ns(wall_s: float) -> int:
    """A `time.time()` stamp as OpenTelemetry's nanoseconds."""
    return int(wall_s * 1e9)


def record(tracer, name: str, parent: TraceContext | None, start_s: float, end_s: float, attributes: dict,
           events: Iterable[tuple[str, float | None]] = (), error: str | None = None) -> TraceContext | None:
    """A span that already happened (wall-clock `start_s` to `end_s`), child of `parent`; events whose stamp
    is None are left out. Returns its context (for a child recorded later)."""
    from opentelemetry.trace import Status, StatusCode

    span = tracer.start_span(name, context=context_of(parent), start_time=ns(start_s),
                             attributes={k: v for k, v in attributes.items() if v is not None})
    for event, stamp in events:
        if stamp is not None:
            span.add_event(event, timestamp=ns(stamp))
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=ns(max(end_s, start_s)))
    return trace_of(span)
