"""Request tracing with OpenTelemetry: one tracer per process and service, off unless asked for.

Every process of a cluster (the ingress, each scheduler shard, each worker) calls `start` once with the
cluster's `TracingSettings` (None when tracing is off, the default). Off, `start` returns None without
importing OpenTelemetry, and each caller's cost is one `is None` test where it would record a span; no
exporter, thread or socket exists. On, spans leave in batches (the SDK's `BatchSpanProcessor`, a thread of
its own) to an OTLP/HTTP endpoint: Jaeger, Tempo or an OpenTelemetry collector.

The standard OTEL_* variables the exporter and the batch processor read (OTEL_EXPORTER_OTLP_HEADERS,
OTEL_BSP_SCHEDULE_DELAY, ...) apply in every process that inherits them; OTEL_SERVICE_NAME and
OTEL_RESOURCE_ATTRIBUTES name the resource. Which endpoint and ratio a cluster uses is decided once, by
the process that starts it (cluster/control/observability_config.py), and travels in the settings.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class TracingSettings:
    endpoint: str  # the OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces
    sample_ratio: float = 1.0  # of the traces that start here; a continued trace keeps its parent's decision


_providers: dict[tuple[TracingSettings, str], object] = {}  # (settings, service) -> its TracerProvider
_lock = threading.Lock()


def start(settings: TracingSettings | None, service: str):
    """The tracer of `service` in this process (one provider per settings and service, made on the first
    call); None when tracing is off."""
    if settings is None:
        return None
    with _lock:
        provider = _providers.get((settings, service))
        if provider is None:
            provider = _providers[(settings, service)] = _provider(settings, service)
    return provider.get_tracer("tandem")


def exporting() -> int:
    """How many span exporters this process has made (0 while tracing is off)."""
    return len(_providers)


def flush(timeout_ms: int = 10_000) -> None:
    """Send every span this process has ended (before a planned stop; the SDK also does it at exit)."""
    for provider in list(_providers.values()):
        provider.force_flush(timeout_ms)


def _provider(settings: TracingSettings, service: str):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    # OTEL_SERVICE_NAME, where set, names every process's resource; `service` tells the processes apart.
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service}
    provider = TracerProvider(resource=Resource.create({"tandem.process": service, **attributes}),
                              sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.endpoint)))
    return provider
