"""What the cluster tells operators beyond /metrics: request tracing (OpenTelemetry). Part of
`TandemConfig` (config.py re-exports it)."""

from __future__ import annotations

import importlib.util
import os
from typing import Mapping

from pydantic import Field

from actors.tracing.tracer import TracingSettings
from cluster.control.config_base import Strict as _Strict


class ObservabilitySection(_Strict):
    otlp_traces_endpoint: str | None = Field(
        None, description="OTLP/HTTP URL every process sends its request spans to (an OpenTelemetry collector, "
        "Jaeger or Tempo: http://host:4318/v1/traces); null: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else "
        "OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces, of the process that starts the cluster; none of them: tracing "
        "is off and costs nothing (OTEL_SDK_DISABLED=true turns it off whatever is set)")
    trace_sample_ratio: float | None = Field(
        None, ge=0, le=1, description="fraction of requests traced (by trace id); a request that arrives with a "
        "`traceparent` header follows its caller's decision; null: OTEL_TRACES_SAMPLER_ARG, else 1.0")

    def tracing(self, env: Mapping[str, str] = os.environ) -> TracingSettings | None:
        """The settings every process of the cluster traces with; None: tracing is off."""
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return None
        endpoint = self.otlp_traces_endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if not endpoint and env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            endpoint = env["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
        if not endpoint:
            return None
        if importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is None:
            raise ValueError(f"tracing to {endpoint} needs OpenTelemetry's OTLP/HTTP exporter: "
                             "pip install 'tandem[tracing]' (or unset the endpoint)")
        ratio = self.trace_sample_ratio
        if ratio is None:
            try:
                ratio = min(max(float(env.get("OTEL_TRACES_SAMPLER_ARG", "1.0")), 0.0), 1.0)
            except ValueError:
                raise ValueError(f"OTEL_TRACES_SAMPLER_ARG {env['OTEL_TRACES_SAMPLER_ARG']!r} is not a number "
                                 "between 0 and 1") from None
        return TracingSettings(endpoint, ratio)
