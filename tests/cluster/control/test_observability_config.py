"""`observability`: tracing is off unless an endpoint is named, in the config or by the standard OTEL_*
variables of the process that starts the cluster; OTEL_SDK_DISABLED wins; the ratio comes from the config,
else OTEL_TRACES_SAMPLER_ARG, else 1."""

from __future__ import annotations

import pytest

from actors.tracing.tracer import TracingSettings
from cluster.control.config import ObservabilitySection, TandemConfig

URL = "http://collector:4318/v1/traces"


def test_off_by_default():
    assert TandemConfig().observability.tracing({}) is None


@pytest.mark.parametrize("config, env, expected", [
    ({"otlp_traces_endpoint": URL}, {}, TracingSettings(URL, 1.0)),
    ({}, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": URL}, TracingSettings(URL, 1.0)),
    ({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"}, TracingSettings(URL, 1.0)),
    ({"otlp_traces_endpoint": URL}, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://other/v1/traces"},
     TracingSettings(URL, 1.0)),  # the config's own key first
    ({}, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": URL, "OTEL_TRACES_SAMPLER_ARG": "0.25"}, TracingSettings(URL, 0.25)),
    ({"otlp_traces_endpoint": URL, "trace_sample_ratio": 0.5}, {"OTEL_TRACES_SAMPLER_ARG": "0.25"},
     TracingSettings(URL, 0.5)),
    ({"otlp_traces_endpoint": URL}, {"OTEL_SDK_DISABLED": "true"}, None),
])
def test_where_the_settings_come_from(config, env, expected):
    assert ObservabilitySection(**config).tracing(env) == expected


def test_bad_values_name_the_field():
    with pytest.raises(ValueError, match="trace_sample_ratio"):
        TandemConfig.model_validate({"observability": {"trace_sample_ratio": 2}})
    with pytest.raises(ValueError, match="otlp_endpoint"):
        TandemConfig.model_validate({"observability": {"otlp_endpoint": URL}})  # a typo of the key
    with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER_ARG"):
        ObservabilitySection().tracing({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": URL, "OTEL_TRACES_SAMPLER_ARG": "x"})
