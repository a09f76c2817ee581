"""The handoff table with a reservation's pages in several pieces (as a tensor-parallel decode worker
receives them: each rank its heads, maybe from several prefill ranks). Here one rank's two KV heads come
as two pieces. The attempt is adopted only when every head has landed; an abort, a failed piece or a
refused one in the middle of another piece's write ends the lease at once but frees its blocks only
when the last write is over; a piece is admitted once, and only for heads its rank holds."""

from __future__ import annotations

import dataclasses

import pytest

from actors.engine.engine import Engine
from actors.protocol.ids import AttemptId
from actors.protocol.messages import GenerateRequest, WorkerRequest
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.tp_messages import KvPiece
from actors.worker.handoff_table import HandoffTable, LeaseRefused
from kv_transfer.page_format import PageFormatError
from tests.helpers.cluster import load


@pytest.fixture
def table():
    engine = Engine(dataclasses.replace(load("local.yaml").engine_config(detokenize=False), num_kv_blocks=16))
    assert engine.kv_heads == (2, ((0, 2),))
    table = HandoffTable(engine, lease_s=30.0)
    request = WorkerRequest(AttemptId("r", "0"), GenerateRequest("r", range(10, 50), SamplingParams(), "tcp://x:1"))
    reservation = table.reserve(request.attempt, len(request.request.prompt_token_ids), request)
    pieces = [KvPiece(reservation.lease_id, 0, head, 1, reservation.block_ids) for head in (0, 1)]
    yield table, engine, request, pieces
    table.check_integrity()
    engine.check_integrity()


def _held(engine: Engine) -> int:
    return len(engine.lease_blocks(AttemptId("r", "0")))


def test_adopted_only_when_every_head_landed(table):
    table, engine, request, (a, b) = table
    table.admit(a)
    table.admit(b)
    assert table.landed(a, ok=True, note=b"n") is None  # head 1 is still being written
    table.check_integrity()
    lease = table.landed(b, ok=True)
    assert lease is not None and lease.context == request and lease.note == b"n"
    assert _held(engine) == 3  # still the lease's until the engine adopts the request
    table.check_integrity()
    engine.adopt(request.attempt, list(request.request.prompt_token_ids), 7, request.request.params)
    table.adopted(request.attempt)
    table.check_integrity()
    assert table.release(request.attempt) is None  # the running request's blocks are no lease
    assert engine.abort(request.attempt) and engine.num_used_blocks == 0


def test_abort_mid_write_frees_the_blocks_after_the_last_write(table):
    table, engine, request, (a, b) = table
    table.admit(a)
    table.admit(b)
    assert table.release(request.attempt) is not None
    table.check_integrity()
    assert table.landed(a, ok=True) is None and _held(engine) == 3  # b is still being written
    assert table.landed(b, ok=True) is None and _held(engine) == 0
    assert table.late_pages_dropped == 2
    with pytest.raises(LeaseRefused, match="lease ended"):
        table.admit(a)


def test_a_failed_piece_fails_the_attempt_once_and_waits_for_the_other(table):
    table, engine, request, (a, b) = table
    table.admit(a)
    table.admit(b)
    assert table.landed(a, ok=False) is not None  # the attempt fails now
    assert _held(engine) == 3 and table.release(request.attempt) is None  # already ended: no second failure
    assert table.landed(b, ok=True) is None and _held(engine) == 0


def test_a_refused_piece_ends_the_lease_while_another_is_written(table):
    table, engine, request, (a, b) = table
    table.admit(a)
    assert table.refused(b.lease_id) is not None
    assert table.refused(b.lease_id) is None and _held(engine) == 3
    assert table.landed(a, ok=True) is None and _held(engine) == 0


def test_each_head_is_admitted_once_and_only_for_its_rank(table):
    table, engine, request, (a, b) = table
    table.admit(a)
    with pytest.raises(LeaseRefused, match="written twice"):
        table.admit(a)
    assert table.landed(a, ok=True) is None
    with pytest.raises(LeaseRefused, match="written twice"):
        table.admit(dataclasses.replace(a, num_heads=2))
    with pytest.raises(PageFormatError, match="rank 1 does not hold heads \\[0, 1\\)"):
        table.admit(dataclasses.replace(b, rank=1, first_head=0))
    with pytest.raises(PageFormatError, match="destination blocks are not the reservation's"):
        table.admit(dataclasses.replace(b, dest_block_ids=b.dest_block_ids[::-1]))
    table.admit(b)
    assert table.landed(b, ok=True) is not None
    assert table.release(request.attempt) is not None and _held(engine) == 0
