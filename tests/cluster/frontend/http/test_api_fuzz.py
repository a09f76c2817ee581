"""Fuzz the API from its own OpenAPI schema, with API keys on: no input gives a 5xx, every JSON response
matches the schema the server publishes, and every server-sent event of a stream is a chunk of the
documented shape, ending in [DONE]. Some cases go without the key (401), the rest with it."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from pydantic import ValidationError

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance  # noqa: E402

from cluster.control.config import TenantSection  # noqa: E402
from cluster.frontend.http.openapi import ChatCompletionChunk, CompletionResponse, ResponseStreamEvent  # noqa: E402
from tests.helpers.cluster import load  # noqa: E402
from tests.helpers.http_server import MODEL, serving  # noqa: E402

pytestmark = pytest.mark.slow  # schemathesis over the whole API

KEY = "fuzz-key-0123456789"
EXTRAS = ("tools", "tool_choice", "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
          "structured_outputs", "prompt_logprobs")
CHUNKS = {"/v1/completions": CompletionResponse, "/v1/chat/completions": ChatCompletionChunk,
          "/v1/responses": ResponseStreamEvent}


@pytest.fixture(scope="module")
def keyed_server(ray_session):
    config = load("local.yaml")
    ingress = config.ingress.model_copy(update={"api_keys": {KEY: TenantSection(tenant="fuzz")}})
    with serving(config.model_copy(update={"ingress": ingress})) as live:
        yield live


def _stream_problems(path: str, text: str, cut_short: bool) -> list[str]:
    """What is wrong with a server-sent event stream of `path`: every event a chunk, [DONE] last. The
    fuzzer stops reading a long stream after a number of events (`cut_short`): then no [DONE] is due."""
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    if not cut_short and (not events or events[-1] != "[DONE]"):
        return [f"the stream does not end with [DONE]: {events[-1:]}"]
    problems = []
    for event in events:
        if event == "[DONE]":
            if event is not events[-1]:
                problems.append("an event after [DONE]")
            continue
        try:
            if "error" in json.loads(event):  # the server failed mid-stream: as bad as a 5xx
                problems.append(f"error event: {event[:300]}")
                continue
            CHUNKS[path].model_validate(json.loads(event))
        except (ValueError, ValidationError) as exc:
            problems.append(f"chunk {event[:200]}: {exc}"[:400])
    return problems


def test_no_input_gives_a_server_error(keyed_server):
    api = schemathesis.openapi.from_url(keyed_server[1] + "/openapi.json")
    ops = [op for op in api.get_all_operations() if op.ok().method in ("post", "get")]
    assert len(ops) == 14  # health, ready, metrics, models, a model, completions, chat, responses, a stored response,
    # a stored chat completion, and vLLM's tokenize, detokenize, tokenizer_info, version
    failures, statuses, refusals = [], {}, {}
    for result in ops:
        operation = result.ok()
        strategy = operation.as_strategy()
        calls = [0]
        # The generation routes get more cases: few fuzzed chat bodies are valid, and the check below wants one.
        examples = 50 if operation.path in ("/v1/completions", "/v1/chat/completions") else 30

        @settings(max_examples=examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck), derandomize=True)
        def check(case):
            calls[0] += 1
            if isinstance(case.body, dict):
                case.body["model"] = MODEL  # else nearly every case stops at 404 before reaching the cluster
                if calls[0] % 2:  # half the cases without the grammar and tool fields, which rarely fuzz valid
                    for key in EXTRAS:
                        case.body.pop(key, None)
            keyed = calls[0] % 5 != 0  # one case in five without the key
            response = case.call(timeout=60, headers={"Authorization": f"Bearer {KEY}"} if keyed else {})
            statuses.setdefault(operation.path, []).append(response.status_code)
            if response.status_code == 400:  # why, for the message if the fuzz never reaches generation
                refusals.setdefault(operation.path, set()).add(response.text[:160])
            content_type = "".join(response.headers.get("content-type") or [])
            if content_type.startswith("application/json"):
                try:  # the body and status must be ones the OpenAPI document declares
                    case.validate_response(response, checks=[response_schema_conformance, status_code_conformance])
                except Exception as exc:
                    failures.append((operation.path, case.body, response.status_code, f"schema: {exc}"[:400]))
            elif content_type.startswith("text/event-stream"):
                failures.extend((operation.path, case.body, response.status_code, p)
                                for p in _stream_problems(operation.path, response.text, response.stream_cut_short))
            if response.status_code >= 500:
                failures.append((operation.path, case.body, response.status_code, response.text[:300]))

        given(strategy)(check)()
    assert not failures, failures[:5]
    for path in ("/v1/completions", "/v1/chat/completions"):  # the fuzz reached generation, not only errors
        assert {200, 400, 401} <= set(statuses[path]), (path, sorted(set(statuses[path])),
                                                         sorted(refusals.get(path, ()))[:10])
    # Whatever the fuzzer happened to stream: one full stream of each kind, read to its end, checked too.
    for path, body in (("/v1/completions", {"prompt": "Once", "n": 2, "logprobs": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                                                 "top_logprobs": 2})):
        full = {"model": MODEL, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}, **body}
        resp = httpx.post(keyed_server[1] + path, json=full, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        assert _stream_problems(path, resp.text, cut_short=False) == []
