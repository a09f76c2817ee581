"""The W3C trace context a request's messages carry survives the one codec, and spans recorded from it (as a
worker records them, after the fact) join the sender's trace with the right parent and times. The SDK's
in-memory exporter stands in for the network here; tests/cluster/test_tracing.py runs the real one."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from actors.protocol.codec import decode_note, decode_to_scheduler, encode
from actors.protocol.messages import GenerateRequest, HandoffNote, TraceContext
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.scheduler_wire import Submit, SubmitBatch
from actors.tracing import tracer as tracing
from actors.tracing.spans import context_of, record, trace_of

PARENT = TraceContext("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "vendor=1")


def test_the_context_rides_the_codec():
    request = GenerateRequest("r1", (1, 2, 3), SamplingParams(), "ipc://sink", trace=PARENT)
    (submit,) = decode_to_scheduler(encode(SubmitBatch((Submit(7, request),)))).submits
    assert submit.request.trace == PARENT
    assert decode_note(encode(HandoffNote(5, 0, "prefill-0", trace=PARENT))).trace == PARENT
    untraced = GenerateRequest("r2", (1,), SamplingParams(), "ipc://sink")
    assert decode_to_scheduler(encode(SubmitBatch((Submit(8, untraced),)))).submits[0].request.trace is None


def test_recorded_spans_continue_the_senders_trace():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    parent_span = tracer.start_span("tandem.schedule", context=context_of(PARENT))
    sent = trace_of(parent_span)
    child = record(tracer, "tandem.decode", sent, 100.0, 101.5, {"tandem.worker_id": "decode-0", "skipped": None},
                   [("landed", 100.25), ("never", None)], error="cancelled")
    parent_span.end()
    decode, schedule = exporter.get_finished_spans()
    assert schedule.context.trace_id == decode.context.trace_id == int(PARENT.traceparent.split("-")[1], 16)
    assert schedule.parent.span_id == int(PARENT.traceparent.split("-")[2], 16)
    assert decode.parent.span_id == schedule.context.span_id
    assert child.traceparent.split("-")[2] == f"{decode.context.span_id:016x}"
    assert (decode.start_time, decode.end_time) == (100_000_000_000, 101_500_000_000)
    assert dict(decode.attributes) == {"tandem.worker_id": "decode-0"}
    assert [(e.name, e.timestamp) for e in decode.events] == [("landed", 100_250_000_000)]
    assert decode.status.description == "cancelled"
    assert sent.tracestate == child.tracestate == "vendor=1"  # the caller's vendor state goes along


def test_off_is_none_and_makes_nothing():
    before = tracing.exporting()
    assert tracing.start(None, "tandem-worker") is None
    assert tracing.exporting() == before
