"""The scheduler's span of a request (tracing on): from its submit's arrival to the decision, admitted
(where its prefill and decode go, how much of its prompt was cached) or rejected (why). The request that
goes on to its workers carries this span's context, so their spans are its children."""

from __future__ import annotations

import dataclasses

from actors.protocol.messages import Admitted, GenerateRequest, Rejected
from actors.tracing.spans import context_of, trace_of


class PlacementSpans:
    def __init__(self, tracer):
        self._tracer = tracer  # None: tracing is off, and each call costs one test

    def begin(self, request: GenerateRequest) -> tuple[object | None, GenerateRequest]:
        """(its span, the request as its workers get it: continuing that span)."""
        if self._tracer is None:
            return None, request
        span = self._tracer.start_span("tandem.schedule", context=context_of(request.trace), attributes={
            "tandem.request_id": request.request_id, "tandem.tenant": request.cache_salt or "",
            "tandem.prompt_tokens": len(request.prompt_token_ids), "tandem.moved": request.moved,
            "tandem.output_prefix_tokens": len(request.output_prefix)})
        trace = trace_of(span)
        return span, request if trace is None else dataclasses.replace(request, trace=trace)

    @staticmethod
    def end(span, answer: Admitted | Rejected | None) -> None:
        if span is None:
            return
        if isinstance(answer, Admitted):
            span.set_attributes({"tandem.admitted": True, "tandem.prefill_worker": answer.prefill,
                                 "tandem.decode_worker": answer.decode, "tandem.cached_tokens": answer.cached_tokens,
                                 "tandem.local_prefill": answer.local})
        else:
            from opentelemetry.trace import Status, StatusCode

            why = answer.reason if isinstance(answer, Rejected) else "the scheduler failed while placing it"
            span.set_attributes({"tandem.admitted": False, "tandem.rejected": why})
            span.set_status(Status(StatusCode.ERROR, why))
        span.end()
