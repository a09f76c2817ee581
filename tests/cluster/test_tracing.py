"""Request tracing (issue 57): one request, sent with the official openai client and a W3C `traceparent`,
is one trace across the ingress, the scheduler and the workers, exported over OTLP/HTTP to a real receiver
in this process. Colocated and 1P+1D (every prompt on the prefill worker): the spans' parents join the
processes (ingress -> scheduler -> prefill -> KV send -> adopt, scheduler -> decode) and carry the request
id, tenant, workers, token counts and the handoff's bytes; a streamed request and one whose client goes away
mid-stream end their spans; a migrated request's second placement joins the same trace. With tracing off no
process makes an exporter."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest
import ray

from actors.tracing import tracer
from tests.helpers.cluster import load, wait_until_idle
from tests.helpers.http_server import MODEL, serving
from tests.helpers.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.slow  # five clusters

MAX_TOKENS = 8
CHUNKS_READ = 12  # of the aborted stream: past the first token (the prefill worker's), into the decode


def _traced(layout: str, endpoint: str | None):
    config = load(layout)
    return config.model_copy(update={
        # 1P+1D: every prompt on the prefill worker
        "scheduler": config.scheduler.model_copy(update={"local_prefill": False}),
        "observability": config.observability.model_copy(update={"otlp_traces_endpoint": endpoint})})


def _caller() -> tuple[str, str, str]:
    """(trace id, the caller's span id, its traceparent header)."""
    trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def _one(spans, name: str):
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{len(found)} spans named {name}: {[(s.name, s.process) for s in spans]}"
    return found[0]


def _check_request_path(spans, caller_span: str, disaggregated: bool) -> dict:
    """The parent links and attributes every traced request shares; returns its spans by name."""
    http = next(s for s in spans if s.name.startswith("POST /v1/"))
    request, schedule = _one(spans, "tandem.request"), _one(spans, "tandem.schedule")
    prefill, decode = _one(spans, "tandem.prefill"), _one(spans, "tandem.decode")
    assert (http.parent_id, http.process) == (caller_span, "tandem-ingress")  # the incoming traceparent continued
    assert (request.parent_id, request.process) == (http.span_id, "tandem-ingress")
    assert (schedule.parent_id, schedule.process) == (request.span_id, "tandem-scheduler")
    assert (prefill.parent_id, prefill.process) == (schedule.span_id, "tandem-worker")
    assert (decode.parent_id, decode.process) == (schedule.span_id, "tandem-worker")
    rid = request.attributes["tandem.request_id"]
    assert {s.attributes["tandem.request_id"] for s in (schedule, prefill, decode)} == {rid}
    assert schedule.attributes["tandem.admitted"] is True
    assert prefill.attributes["tandem.worker_id"] == schedule.attributes["tandem.prefill_worker"]
    assert decode.attributes["tandem.worker_id"] == schedule.attributes["tandem.decode_worker"]
    assert prefill.attributes["tandem.prompt_tokens"] == request.attributes["tandem.prompt_tokens"] > 0
    assert "first_token" in prefill.events or "scheduled" in prefill.events
    assert (prefill.attributes["tandem.worker_role"], decode.attributes["tandem.worker_role"]) == (
        ("prefill", "decode") if disaggregated else ("colocated", "colocated"))
    named = {"http": http, "request": request, "schedule": schedule, "prefill": prefill, "decode": decode}
    if disaggregated:
        send, adopt = _one(spans, "tandem.kv_send"), _one(spans, "tandem.kv_adopt")
        assert (send.parent_id, adopt.parent_id) == (prefill.span_id, send.span_id)  # joined by the handoff note
        assert send.attributes["tandem.kv_bytes"] == adopt.attributes["tandem.kv_bytes"] > 0
        assert send.attributes["tandem.decode_worker"] == decode.attributes["tandem.worker_id"]
        assert adopt.attributes["tandem.prefill_worker"] == prefill.attributes["tandem.worker_id"]
        assert adopt.attributes["tandem.worker_id"] == decode.attributes["tandem.worker_id"]
        assert "landed" in adopt.events
        named.update(send=send, adopt=adopt)
    else:
        assert not [s for s in spans if s.name.startswith("tandem.kv_")]
    return named


def _expected(disaggregated: bool) -> dict[str, int]:
    names = {"tandem.request": 1, "tandem.schedule": 1, "tandem.prefill": 1, "tandem.decode": 1}
    return {**names, "tandem.kv_send": 1, "tandem.kv_adopt": 1} if disaggregated else names


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as r:
        yield r


@pytest.mark.parametrize("layout", ["colocated.yaml", "local.yaml"])
def test_one_trace_across_processes(ray_session, receiver, layout):
    disaggregated = layout == "local.yaml"
    with serving(_traced(layout, receiver.endpoint)) as (cluster, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        trace_id, caller, header = _caller()
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me about the sea"}], max_tokens=MAX_TOKENS,
            temperature=0, extra_body={"ignore_eos": True}, extra_headers={"traceparent": header})
        spans = _check_request_path(receiver.wait_for(trace_id, _expected(disaggregated)), caller, disaggregated)
        assert spans["http"].attributes["http.response.status_code"] == 200
        assert spans["request"].attributes["tandem.output_tokens"] == chat.usage.completion_tokens == MAX_TOKENS
        assert spans["request"].attributes["tandem.finish_reasons"] == ["length"]
        assert spans["request"].attributes["tandem.prompt_tokens"] == chat.usage.prompt_tokens
        assert spans["decode"].attributes["tandem.output_tokens"] == MAX_TOKENS
        assert spans["decode"].attributes["tandem.status"] == "FINISHED_LENGTH"

        # Streamed: the ingress's spans end with the stream.
        trace_id, caller, header = _caller()
        chunks = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True},
                                           extra_headers={"traceparent": header})
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        spans = _check_request_path(receiver.wait_for(trace_id, _expected(disaggregated)), caller, disaggregated)
        assert text and spans["request"].attributes["tandem.output_tokens"] == MAX_TOKENS
        wait_until_idle(cluster)


def test_an_aborted_stream_ends_its_spans(ray_session, receiver):
    """The client goes away after some chunks of a long answer (the decode worker's by then): the ingress's
    spans end (finish reason abort), and the decode worker records its decode span as cancelled when the
    abort reaches it."""
    with serving(_traced("local.yaml", receiver.endpoint)) as (cluster, base):
        trace_id, caller, header = _caller()
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, headers={"traceparent": header},
                          timeout=120) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data:"))
            chunks = [json.loads(next(lines).removeprefix("data:")) for _ in range(CHUNKS_READ)]
        assert all(chunk["choices"] for chunk in chunks)
        wait_until_idle(cluster)
        spans = receiver.wait_for(trace_id, {"tandem.request": 1, "tandem.schedule": 1, "tandem.decode": 1})
        request, decode = _one(spans, "tandem.request"), _one(spans, "tandem.decode")
        assert request.attributes["tandem.finish_reasons"] == ["abort"]
        assert CHUNKS_READ <= request.attributes["tandem.output_tokens"] < 1500
        assert decode.attributes["tandem.status"] == "CANCELLED"
        assert decode.parent_id == _one(spans, "tandem.schedule").span_id
        assert next(s for s in spans if s.name.startswith("POST /v1/")).parent_id == caller


def test_tracing_off_makes_no_exporter(ray_session, receiver, monkeypatch):
    """The default: no endpoint, no OTEL_* variable; a served request leaves no exporter in the ingress, the
    scheduler or a worker, and nothing reaches the receiver."""
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    config = load("local.yaml")
    assert config.observability.tracing() is None
    before, exports = tracer.exporting(), receiver.exports
    with serving(config) as (cluster, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        trace_id, _, header = _caller()
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_headers={"traceparent": header})
        wait_until_idle(cluster)
        counts = [ray.get(actor.__ray_call__.remote(lambda _: __import__("actors.tracing.tracer").tracing.tracer
                                                    .exporting()), timeout=30)
                  for actor in [*cluster.schedulers, *cluster.workers.values()]]
    assert counts == [0] * len(counts)  # fresh processes: none ever made one
    assert tracer.exporting() == before  # the ingress (this process) made none
    assert receiver.exports == exports and receiver.trace(trace_id) == []


def test_a_migrated_request_is_one_trace(ray_session, receiver):
    """Its decode worker dies mid-stream (Ray restarts it) and the client moves the request: the new attempt's
    placement is a second `tandem.schedule` under the same `tandem.request`, marked moved with the tokens the
    client already had, and the attempt that finishes it records its decode span under that placement."""
    with serving(_traced("local.yaml", receiver.endpoint)) as (cluster, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        trace_id, caller, header = _caller()
        stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=120, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True},
                                           extra_headers={"traceparent": header})
        chunks = 0
        for _ in stream:
            chunks += 1
            if chunks == 5:
                ray.kill(cluster.workers["decode-0"], no_restart=False)  # Ray restarts it; the request moves
        wait_until_idle(cluster)
        spans = receiver.wait_for(trace_id, {"tandem.request": 1, "tandem.schedule": 2})
        request = _one(spans, "tandem.request")
        assert request.attributes["tandem.moves"] >= 1 and request.attributes["tandem.output_tokens"] >= 120
        schedules = sorted((s for s in spans if s.name == "tandem.schedule"), key=lambda s: s.start_ns)
        assert {s.parent_id for s in schedules} == {request.span_id}
        first, moved = schedules[0], schedules[-1]
        assert (first.attributes["tandem.moved"], moved.attributes["tandem.moved"]) == (False, True)
        assert moved.attributes["tandem.output_prefix_tokens"] >= 5 and moved.attributes["tandem.admitted"]
        spans = receiver.wait_for(trace_id, {"tandem.decode": 1})
        finished = [s for s in spans
                    if s.name == "tandem.decode" and s.attributes["tandem.status"] == "FINISHED_LENGTH"]
        assert [s.parent_id for s in finished] == [moved.span_id]
