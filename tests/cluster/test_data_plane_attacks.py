"""Attacks on a running cluster's data plane, replayed on loopback (KV pages and tokens over tcp).

A peer on the network that lacks the cluster's secret key forges token deltas for a request whose wire
id it sniffed, pushes a transfer at the decode worker's KV socket, submits and aborts at the scheduler's
port and sprays raw bytes at every port: none of it lands, and every request still gets the engine's greedy output. A decode worker whose KV
receiving thread dies restarts itself instead of heartbeating on as a worker that can never adopt.
"""

from __future__ import annotations

import socket
import time

import pytest
import ray
import torch
import zmq

from actors.protocol.scheduler_wire import AbortRequests, Submit, SubmitBatch
from actors.protocol.codec import encode
from actors.protocol.ids import AttemptId
from actors.protocol.messages import GenerateRequest, TokenDelta
from actors.protocol.request_status import RequestStatus
from actors.protocol.token_stream import TokenPublisher
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client
from kv_transfer.curve import CurveKeys, rejected_handshakes
from kv_transfer.page_format import PageSpec, TransferError, TransferHeader, encode_header
from kv_transfer.zmq_transport import ZmqKVSender
from tests.helpers.cluster import collect_tokens, load, wait_until_idle, workload
from tests.helpers.sockets import offer, stranger


def tcp_config():
    config = load("local.yaml")
    return config.model_copy(update={"transfer": config.transfer.model_copy(update={"zmq_transport": "tcp"})})


@pytest.fixture(scope="module")
def cluster(ray_session):
    live = Cluster.start(tcp_config())
    yield live
    live.shutdown()


def _spray(endpoint: str) -> None:
    """Raw bytes at a zmq port: not even a handshake."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(b"\xc1 not msgpack" * 1000)


def test_strangers_cannot_inject_tokens_or_pages(cluster, expected):
    assert cluster.keys is not None  # tcp sockets get CURVE by default
    prompts, params = workload()
    client = open_client(cluster)
    kv_endpoint = ray.get(cluster.workers["decode-0"].info.remote(), timeout=30).kv_endpoints[0].endpoint
    refused_before = rejected_handshakes()
    submitted = [client.submit(p, sp) for p, sp in zip(prompts, params)]

    # Forged ends for every request, under any attempt name the attacker might have sniffed.
    attempts = [AttemptId(s.request_id, a) for s in submitted for a in ("0", "1", "a")]
    forged = [TokenDelta(a, 0, 0, (66,), RequestStatus.FINISHED_STOPPED, error="attacker") for a in attempts]
    publishers = [TokenPublisher(), TokenPublisher(keys=CurveKeys.generate())]
    strangers = [stranger(client.sink, cluster.keys.public), stranger(kv_endpoint, cluster.keys.public)]
    pages = ZmqKVSender()  # a plain zmq peer at the KV socket
    try:
        for publisher in publishers:
            publisher.publish(client.sink, forged)
        header = TransferHeader("forged", "forged", PageSpec("float32", 16, 1, 1, 1), (0,), b"")
        offer(strangers[0], encode(forged))
        offer(strangers[1], encode_header(header), b"\x00" * 64, b"\x00" * 64)
        src = [(torch.zeros(4, 16, 1, 1), torch.zeros(4, 16, 1, 1))]
        with pytest.raises(TransferError, match="no receiver"):  # nothing is queued for an unadmitted peer
            pages.send(kv_endpoint, TransferHeader("forged", "forged", PageSpec.from_caches(src), (0,)),
                       src, [0], timeout_s=1.0)
        for endpoint in (client.sink, kv_endpoint):
            _spray(endpoint)
        outputs = [collect_tokens(client, handle) for handle in submitted]
    finally:
        for closable in (*publishers, pages):
            closable.close()
        for sock in strangers:
            sock.close(linger=0)

    assert outputs == expected
    deadline = time.monotonic() + 10
    while rejected_handshakes() == refused_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rejected_handshakes() > refused_before  # the sink's ZAP check refused the stranger's key
    assert client.drops.snapshot() == {}  # nothing from a stranger ever reached a receiving loop
    state = wait_until_idle(cluster)
    assert state["workers"]["decode-0"]["dropped_messages"] == ()
    assert state["workers"]["decode-0"]["used_blocks"] == 0


def test_strangers_cannot_submit_or_abort_at_the_scheduler(cluster, expected):
    prompts, params = workload()
    client = open_client(cluster)
    port = ray.get(cluster.scheduler.client_port.remote(), timeout=30).endpoint
    before = ray.get(cluster.scheduler.state.remote(), timeout=30).counters.submitted
    submitted = [client.submit(p, sp) for p, sp in zip(prompts, params)]
    attacker = stranger(port, cluster.keys.public, zmq.DEALER)
    try:
        # A flood of admissions for the attacker, and aborts of every request it saw the id of.
        flood = tuple(Submit(i, GenerateRequest(f"attacker-{i}", (5,) * 64, params[0], client.sink)) for i in range(50))
        offer(attacker, encode(SubmitBatch(flood)))
        offer(attacker, encode(AbortRequests(0, tuple(s.request_id for s in submitted))))
        _spray(port)
        outputs = [collect_tokens(client, handle) for handle in submitted]
    finally:
        attacker.close(linger=0)

    assert outputs == expected  # none was aborted
    state = wait_until_idle(cluster)  # (the refused handshakes are counted in the scheduler's process)
    assert state["scheduler"]["counters"]["submitted"] == before + len(prompts)  # nothing of the attacker's was admitted
    assert state["scheduler"]["port_drops"] == {}  # nor did any of it reach the port's receiving loop


def test_a_dead_kv_receiver_restarts_its_worker(cluster, expected):
    before = ray.get(cluster.scheduler.state.remote(), timeout=30).incarnations["decode-0"]
    ray.get(cluster.workers["decode-0"].inject_fault.remote("kill_kv_receiver"), timeout=30)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = ray.get(cluster.scheduler.state.remote(), timeout=30).incarnations.get("decode-0")
        if now not in (None, before):
            break
        time.sleep(0.1)
    else:
        pytest.fail("decode-0 did not come back as a new process after its KV receiver died")
    prompts, params = workload()
    results = open_client(cluster).generate(prompts, params)
    assert [r[0].token_ids for r in results] == expected
    wait_until_idle(cluster)
