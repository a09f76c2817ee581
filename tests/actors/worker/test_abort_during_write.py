"""Regression: an abort while a reservation's pages are being written must not free those blocks.

Before the handoff table, `abort` freed a reservation's blocks at once, while the receiver thread was
still about to write the transfer's pages into them; the next request took the freed blocks, and the
late pages overwrote its KV (another tenant's). Here a fault hook holds an admitted write, the
reservation is aborted in the middle, a request that can only run in those blocks is submitted, and the
write is let go once that request has produced a token (or after a moment, if it cannot start): its
greedy output must equal the single-process engine's, and the late pages must be dropped and counted.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import zmq

from actors.engine.engine import Engine
from actors.protocol.codec import decode_deltas, encode
from actors.protocol.ids import AttemptId
from actors.protocol.messages import GenerateRequest, HandoffNote, WorkerRequest
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.tp_messages import KvSendPlan
from actors.protocol.worker_commands import AbortAttempt, ReserveBlocks, SubmitAttempt
from actors.worker.actor import Worker
from actors.worker.kv_handoff import HandoffSender
from actors.worker.spec import WorkerSpec
from tests.helpers.cluster import load
from tests.helpers.command_port import CommandLine

NUM_BLOCKS = 8  # blocks of 16 tokens: the aborted reservation takes 6, the next request needs 4
HOLD_MAX_S = 30.0


@pytest.fixture
def decode():
    engine = dataclasses.replace(load("local.yaml").engine_config(detokenize=False), num_kv_blocks=NUM_BLOCKS)
    worker = Worker(WorkerSpec("decode-t", "decode", engine, lease_s=30.0, heartbeat_s=0.02))
    yield worker, engine
    worker.shutdown()


def reserve(worker, ask: ReserveBlocks):
    """Asked on the worker's command port, as the scheduler asks."""
    line = CommandLine(worker.info().command_endpoint)
    try:
        return line.reserve(ask)
    finally:
        line.close()


def wait_for(predicate, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
    return value


def test_abort_during_a_page_write_keeps_the_blocks_until_the_write_is_over(decode):
    worker, engine = decode
    sink = zmq.Context.instance().socket(zmq.PULL)
    sink_url = f"tcp://127.0.0.1:{sink.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
        aborted = WorkerRequest(AttemptId("tenant-a", "0"), GenerateRequest("tenant-a", range(100, 196), params,
                                                                            sink_url))
        (reservation,) = reserve(worker, ReserveBlocks("decode-t", aborted))
        assert len(reservation.block_ids) == 6

        # Pages of garbage from a "prefill worker": were they written into another request's blocks,
        # its greedy tokens would change.
        source = Engine(engine)
        for k, v in source.kv_caches:
            k.normal_(0, 50.0)
            v.normal_(0, 50.0)
        worker.inject_fault("hold_kv_writes", HOLD_MAX_S)
        worker.check_integrity()  # the fault is queued for the engine thread: in place once this returns
        sender = HandoffSender(source.kv_caches)
        note = encode(HandoffNote(first_token=7, num_cached_tokens=0, prefill_worker="prefill-t"))
        sender.send(KvSendPlan(reservation.lease_id, tuple(range(6)), reservation.block_ids,
                               worker.info().kv_endpoints, note, timeout_s=10.0))
        wait_for(lambda: worker.check_integrity().writing == 1)

        worker.handle(AbortAttempt("decode-t", aborted.attempt))  # mid-write
        prompt = list(range(300, 340))
        (expected,) = Engine(engine).generate([prompt], params)
        worker.handle(SubmitAttempt("decode-t", WorkerRequest(AttemptId("tenant-b", "0"),
                                                    GenerateRequest("tenant-b", prompt, params, sink_url))))
        tokens = []
        if not sink.poll(500):  # it cannot start while the aborted blocks are still being written
            worker.inject_fault(None)
        while True:
            assert sink.poll(60_000), "no tokens from the request that needed the aborted blocks"
            (delta,) = decode_deltas(sink.recv())
            assert delta.attempt.request_id == "tenant-b", delta
            tokens.extend(delta.token_ids)
            worker.inject_fault(None)  # the write goes on now, with the request mid-way
            if delta.status.is_finished():
                break
        assert tokens == expected.outputs[0].token_ids

        stats = wait_for(lambda: (s := worker.check_integrity()).live_requests == 0 and s)
        assert stats.late_pages_dropped == 1
        assert stats.writing == stats.reserved == stats.used_blocks == 0
        assert stats.adopted == 0
        sender.close()
    finally:
        sink.close(linger=0)


def test_pages_for_an_ended_lease_are_refused_before_writing(decode):
    """Pages that arrive after their reservation was aborted are refused outright and counted."""
    worker, engine = decode
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    request = WorkerRequest(AttemptId("r", "0"), GenerateRequest("r", range(10, 42), params, "tcp://127.0.0.1:9"))
    (reservation,) = reserve(worker, ReserveBlocks("decode-t", request))
    worker.handle(AbortAttempt("decode-t", request.attempt))
    wait_for(lambda: worker.check_integrity().reserved == 0)
    source = Engine(engine)
    sender = HandoffSender(source.kv_caches)
    sender.send(KvSendPlan(reservation.lease_id, (0, 1), reservation.block_ids, worker.info().kv_endpoints, b"",
                           timeout_s=10.0))
    stats = wait_for(lambda: (s := worker.check_integrity()).late_pages_dropped == 1 and s)
    assert stats.used_blocks == 0 and stats.writing == 0
    sender.close()
