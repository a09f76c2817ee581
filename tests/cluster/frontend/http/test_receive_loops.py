"""Garbage on every zmq socket of a served cluster (the token sink, a KV receiver, the scheduler's port,
a worker's command port), with CURVE off so that it gets in at all: each
message is dropped and counted on `/metrics`, the streams go on, and `/health` says so when the
ingress's own receiving thread is dead (killed here on purpose)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import ray
import zmq
from prometheus_client.parser import text_string_to_metric_families

from actors.engine.engine import Engine
from actors.protocol.sampling_params import SamplingParams
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.http.server import make_server
from tests.helpers.cluster import load, wait_until_idle
from tests.helpers.http_server import MODEL, running
from tests.helpers.sockets import raw_push

GARBAGE = [[b"\xc1 not msgpack"], [b"\x00" * 100], [b"\x93\x01\x02"], [b"x", b"y", b"z"]]


def _dropped(base_url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    return {(s.labels["socket"], s.labels["reason"]): s.value
            for family in text_string_to_metric_families(text) if family.name == "tandem:dropped_messages_total"
            for s in family.samples}


@pytest.fixture(scope="module")
def plain_server(ray_session):
    config = load("local.yaml")
    config = config.model_copy(update={"transfer": config.transfer.model_copy(update={"encryption": "none"})})
    cluster = Cluster.start(config)
    try:
        server = make_server(cluster, "127.0.0.1", 0)
        with running(server) as url:
            yield cluster, url, server.ingress.client
    finally:
        cluster.shutdown()


def test_garbage_is_counted_and_streams_go_on(plain_server):
    cluster, base_url, ingress_client = plain_server
    assert cluster.keys is None
    sink = ingress_client.sink
    kv_endpoint = ray.get(cluster.workers["decode-0"].info.remote(), timeout=30).kv_endpoints[0].endpoint
    raw_push(sink, GARBAGE)
    raw_push(kv_endpoint, GARBAGE)
    port = ray.get(cluster.scheduler.client_port.remote(), timeout=30).endpoint
    raw_push(port, GARBAGE, zmq.DEALER)
    commands = ray.get(cluster.workers["prefill-0"].info.remote(), timeout=30).command_endpoint
    raw_push(commands, GARBAGE, zmq.DEALER)

    prompt = "The quick brown fox"
    (ref,) = Engine(load("local.yaml").engine_config()).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == ref.outputs[0].text

    deadline = time.monotonic() + 30
    want = {("token_sink", "malformed"): 6.0, ("kv_receiver", "malformed"): 4.0, ("scheduler_port", "malformed"): 4.0,
            ("command_port", "malformed"): 4.0}
    while (dropped := _dropped(base_url)) != want and time.monotonic() < deadline:
        time.sleep(0.2)  # the workers' counts arrive with their next report
    assert dropped == want  # every frame of a stray multipart message counts on the sink (it reads single frames)
    assert httpx.get(base_url + "/health", timeout=30).status_code == 200
    wait_until_idle(cluster)


def test_health_fails_once_the_token_receiver_is_dead(plain_server):
    cluster, base_url, ingress_client = plain_server
    ingress_client.kill_sink()
    health = httpx.get(base_url + "/health", timeout=30)
    assert health.status_code == 503
    assert "token sink" in health.json()["reason"]
