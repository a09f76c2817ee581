"""The HTTP request's span at the ingress (tracing on): a SERVER span around every API route's exchange,
from its first byte in to its last byte out or the client's disconnect, continuing the trace of an
incoming W3C `traceparent` header (the caller's). The request spans of the cluster requests it opens are
its children (request_spans.py). Added to the app only when tracing is on."""

from __future__ import annotations

from cluster.frontend.http.body_guard import API_PREFIXES, Receive, Scope, Send


class TraceMiddleware:
    def __init__(self, app, tracer):
        self.app, self.tracer = app, tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(API_PREFIXES):
            await self.app(scope, receive, send)
            return
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())
                   if k in (b"traceparent", b"tracestate")}
        method = scope.get("method", "")
        span = self.tracer.start_span(f"{method} {path}", context=TraceContextTextMapPropagator().extract(headers),
                                      kind=SpanKind.SERVER,
                                      attributes={"http.request.method": method, "url.path": path})
        status: list[int] = []

        async def sent(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                span.set_attribute("http.response.status_code", message["status"])
            await send(message)

        try:
            with trace.use_span(span, end_on_exit=False):
                await self.app(scope, receive, sent)
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            if status and status[0] >= 500:
                span.set_status(Status(StatusCode.ERROR, f"HTTP {status[0]}"))
            span.end()
