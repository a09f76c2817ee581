"""Handoff leases: a reservation whose KV never arrives is released at the end of its lease (never
before, and without hanging), counted, and its request fails with a clear error. How late after the
deadline a lease is released is a timing (`lease_overrun_s` in the worker's stats), not asserted here."""

from __future__ import annotations

import time

import pytest
import ray
import zmq

from actors.protocol.codec import decode_deltas
from actors.protocol.ids import AttemptId
from actors.protocol.messages import GenerateRequest, KvDestination, KvRankEndpoint, KvReservation, WorkerRequest
from actors.protocol.request_status import RequestStatus
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.worker_commands import ReserveBlocks, SubmitAttempt
from actors.worker.remote import worker_actor
from actors.worker.spec import WorkerSpec
from cluster.control.config import SchedulerSection
from tests.helpers.command_port import CommandLine
from tests.helpers.cluster import load

LEASE_S = 1.0
NO_HANG_S = 10.0  # a busy machine delays the release; only a hang fails


@pytest.mark.parametrize("lease_s", [
    LEASE_S,
    # The lease as shipped (the config model's default): half a minute.
    pytest.param(SchedulerSection().lease_s, marks=pytest.mark.slow, id="shipped"),
])
def test_reservation_without_pages_expires_at_the_lease(ray_session, lease_s):
    """A decode worker's reservation whose pages never come is released when its lease ends, not before and
    without hanging, counted, and its request fails as retryable (its client continues it elsewhere, as
    test_lost_handoff.py shows)."""
    engine = load("local.yaml").engine_config(detokenize=False)
    worker = worker_actor().options(num_cpus=0.5, max_concurrency=16).remote(
        WorkerSpec("decode-lease", "decode", engine, lease_s=lease_s, heartbeat_s=SchedulerSection().heartbeat_s))
    sink = zmq.Context.instance().socket(zmq.PULL)
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    try:
        line = CommandLine(ray.get(worker.info.remote(), timeout=120).command_endpoint)
        attempt = AttemptId("never-sent", "a0")
        request = WorkerRequest(attempt, GenerateRequest("never-sent", range(10, 50), SamplingParams(max_tokens=4),
                                                         f"tcp://127.0.0.1:{port}"))
        start = time.monotonic()
        (reservation,) = line.reserve(ReserveBlocks("decode-lease", request))
        assert len(reservation.block_ids) == 3  # 40 tokens in blocks of 16
        assert sink.poll(int((lease_s + NO_HANG_S) * 1000)), f"no failure reported {NO_HANG_S}s after the lease"
        (delta,) = decode_deltas(sink.recv())
        assert time.monotonic() - start >= lease_s
        assert (delta.attempt, delta.status, delta.retryable) == (attempt, RequestStatus.FAILED, True)
        assert f"did not arrive within the {lease_s}s lease" in delta.error
        stats = ray.get(worker.check_integrity.remote(), timeout=30)
        assert stats.reserved == 0 and stats.used_blocks == 0 and stats.leases_expired == 1
        line.close()
    finally:
        sink.close(linger=0)
        ray.get(worker.shutdown.remote(), timeout=30)
        ray.kill(worker)


def test_hold_without_release_expires_within_the_lease(ray_session):
    """A prefill worker whose pages are taken but never acknowledged frees its hold at the lease."""
    engine = load("local.yaml").engine_config(detokenize=False)
    worker = worker_actor().options(num_cpus=0.5, max_concurrency=16).remote(
        WorkerSpec("prefill-lease", "prefill", engine, lease_s=LEASE_S, heartbeat_s=0.02))
    ctx = zmq.Context.instance()
    sink, pages = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)  # `pages` plays a decode worker that never acks
    sink_port = sink.bind_to_random_port("tcp://127.0.0.1")
    pages_port = pages.bind_to_random_port("tcp://127.0.0.1")
    try:
        line = CommandLine(ray.get(worker.info.remote(), timeout=120).command_endpoint)
        target = KvRankEndpoint(f"tcp://127.0.0.1:{pages_port}", 0, 2, 2)  # the tiny model's 2 KV heads
        dest = KvDestination("decode-x", (target,), KvReservation("l1", (7, 8, 9)))
        request = WorkerRequest(AttemptId("never-acked", "a0"), GenerateRequest(
            "never-acked", range(10, 50), SamplingParams(max_tokens=4, temperature=0.0),
            f"tcp://127.0.0.1:{sink_port}"), dest)
        line.send(SubmitAttempt("prefill-lease", request))
        assert pages.poll(30_000) and pages.recv_multipart()  # the pages left the prefill worker
        sent = time.monotonic()
        (first,) = decode_deltas(sink.recv())
        assert first.status == RequestStatus.TRANSFERRING and len(first.token_ids) == 1
        while True:
            stats = ray.get(worker.check_integrity.remote(), timeout=30)
            if stats.held == 0:
                break
            assert time.monotonic() - sent <= LEASE_S + NO_HANG_S, stats
            time.sleep(0.02)
        assert time.monotonic() - sent >= LEASE_S * 0.9
        assert stats.leases_expired == 1 and stats.used_blocks == 0 and stats.transfers_sent == 1
        line.close()
    finally:
        sink.close(linger=0)
        pages.close(linger=0)
        ray.get(worker.shutdown.remote(), timeout=30)
        ray.kill(worker)
