"""A real OTLP/HTTP trace receiver in the test process: what an OpenTelemetry collector's `otlphttp`
receiver does, reduced to keeping the spans. Every export is decoded with opentelemetry-proto's
`ExportTraceServiceRequest`, as a collector would; a wait fails naming what it still misses."""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    process: str  # the resource's tandem.process (tandem-ingress, tandem-scheduler, tandem-worker)
    attributes: dict
    events: list[str] = field(default_factory=list)
    error: str | None = None  # the status message of an errored span
    start_ns: int = 0
    end_ns: int = 0


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


class OtlpReceiver:
    def __init__(self):
        self.spans: list[ReceivedSpan] = []
        self.exports = 0  # POSTs received
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._take(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _take(self, request: ExportTraceServiceRequest) -> None:
        got = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    got.append(ReceivedSpan(
                        s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                        resource.get("tandem.process", ""), {a.key: _value(a.value) for a in s.attributes},
                        [e.name for e in s.events], s.status.message if s.status.code == 2 else None,
                        s.start_time_unix_nano, s.end_time_unix_nano))
        with self._lock:
            self.exports += 1
            self.spans += got

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: dict[str, int], timeout_s: float = 120.0) -> list[ReceivedSpan]:
        """The trace's spans once it holds at least `names[name]` spans of each name (spans arrive in
        batches, from several processes); fails naming the ones still missing."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            missing = {n: k - sum(s.name == n for s in spans) for n, k in names.items()}
            missing = {n: k for n, k in missing.items() if k > 0}
            if not missing:
                return spans
            assert time.monotonic() < deadline, (f"trace {trace_id}: still missing {missing} after {timeout_s:g} s; "
                                                 f"got {sorted(s.name for s in spans)}")
            time.sleep(0.1)
