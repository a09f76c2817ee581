"""Acceptance 2 of the ingress issue: fuzz the API from its own OpenAPI schema; no input gives a 5xx,
and every JSON response matches the schema the server publishes."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance  # noqa: E402

from tests.helpers.http_server import MODEL


@pytest.fixture(scope="module")
def api(server):  # noqa: F811
    return schemathesis.openapi.from_url(server[1] + "/openapi.json")


def test_no_input_gives_a_server_error(api):
    ops = [op for op in api.get_all_operations() if op.ok().method in ("post", "get")]
    assert len(ops) == 6  # health, ready, metrics, models, completions, chat
    failures, statuses = [], {}
    for result in ops:
        operation = result.ok()
        strategy = operation.as_strategy()

        @settings(max_examples=30, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck), derandomize=True)
        def check(case):
            if isinstance(case.body, dict):
                case.body["model"] = MODEL  # else nearly every case stops at 404 before reaching the cluster
            response = case.call(timeout=60)
            statuses.setdefault(operation.path, []).append(response.status_code)
            content_type = "".join(response.headers.get("content-type") or [])
            if content_type.startswith("application/json"):
                try:  # the body and status must be ones the OpenAPI document declares
                    case.validate_response(response, checks=[response_schema_conformance, status_code_conformance])
                except Exception as exc:
                    failures.append((operation.path, case.body, response.status_code, f"schema: {exc}"[:400]))
            if response.status_code >= 500:
                failures.append((operation.path, case.body, response.status_code, response.text[:300]))

        given(strategy)(check)()
    assert not failures, failures[:5]
    for path in ("/v1/completions", "/v1/chat/completions"):  # the fuzz reached generation, not only errors
        assert 200 in statuses[path] and 400 in statuses[path], (path, sorted(set(statuses[path])))
