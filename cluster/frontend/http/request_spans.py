"""The ingress's span of each cluster request (tracing on): `tandem.request`, from its admission asked to
its end, however it ended (finished, refused, timed out, or aborted by a client that went away), child of
the HTTP request's span (trace_middleware.py). Its context travels with the request to the scheduler,
whose span the workers' spans continue: one trace per request across every process it touched."""

from __future__ import annotations

import dataclasses

from actors.protocol.messages import GenerateRequest
from actors.tracing.spans import trace_of
from cluster.frontend.request_stream import RequestStream


class RequestSpans:
    def __init__(self, tracer):
        self.tracer = tracer  # None: tracing is off, and each call costs one test
        self._open: dict[str, object] = {}  # request id -> its span, until the request ends

    def opened(self, request: GenerateRequest) -> GenerateRequest:
        """The request as it goes to the scheduler: carrying its new span's context."""
        if self.tracer is None:
            return request
        span = self.tracer.start_span("tandem.request", attributes={
            "tandem.request_id": request.request_id, "tandem.tenant": request.cache_salt or "",
            "tandem.prompt_tokens": len(request.prompt_token_ids), "tandem.max_tokens": request.params.max_tokens,
            "tandem.n": request.params.n})
        self._open[request.request_id] = span
        trace = trace_of(span)
        return request if trace is None else dataclasses.replace(request, trace=trace)

    def refused(self, request_id: str, error: BaseException) -> None:
        """It was never admitted (rejected, no answer, a lost scheduler)."""
        span = self._open.pop(request_id, None)
        if span is not None:
            why = getattr(error, "reason", None) or str(error) or type(error).__name__  # AdmissionRejected's reason
            span.set_attribute("tandem.rejected", why)
            _error(span, f"not admitted: {why}")
            span.end()

    def finished(self, stream: RequestStream) -> None:
        span = self._open.pop(stream.request_id, None)
        if span is None:
            return
        reasons = [r.finish_reason or "abort" for r in stream.results]
        span.set_attributes({"tandem.output_tokens": stream.received_tokens, "tandem.finish_reasons": reasons,
                             "tandem.cached_tokens": stream.results[0].num_cached_tokens,
                             "tandem.moves": stream.moves, "tandem.stalls": stream.stalls,
                             "tandem.timed_out": stream.timed_out})
        errors = [r.error for r in stream.results if r.error]
        if errors:
            _error(span, errors[0])
        span.end()


def _error(span, message: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, message))
