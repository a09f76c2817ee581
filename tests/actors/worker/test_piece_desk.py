"""Rank 0's piece desk over a real ipc socket: it answers each rank's admit with the handoff table's
verdict (write / drop quietly / refuse), passes piece outcomes on, and survives garbage."""

from __future__ import annotations

import queue
import time

import pytest
import zmq

from actors.protocol.tp_messages import KvPiece, PieceEvent
from actors.worker.handoff_table import LeaseRefused
from actors.worker.piece_desk import DeskClient, PieceDesk
from kv_transfer.page_format import PageFormatError


def _admit(piece: KvPiece) -> None:
    if piece.lease_id == "ended":
        raise LeaseRefused("no live reservation (lease ended)")
    if piece.lease_id == "bad":
        raise PageFormatError("destination blocks are not the reservation's")


@pytest.fixture
def desk():
    events: queue.Queue = queue.Queue()
    desk = PieceDesk(_admit, events.put)
    client = DeskClient(desk.address)
    yield desk, client, events
    client.close()
    desk.close()


def test_verdicts_and_reports(desk):
    desk, client, events = desk
    client.admit(KvPiece("live", 1, 2, 2, (4, 5)))
    with pytest.raises(LeaseRefused, match="lease ended"):
        client.admit(KvPiece("ended", 1, 2, 2, (4, 5)))
    with pytest.raises(PageFormatError, match="not the reservation's") as refused:
        client.admit(KvPiece("bad", 1, 2, 2, (4, 5)))
    assert not isinstance(refused.value, LeaseRefused)  # a real refusal: the attempt fails
    landed = PieceEvent(KvPiece("live", 1, 2, 2, (4, 5)), "landed", note=b"n", nbytes=4096)
    client.report(landed)
    assert events.get(timeout=10) == landed


def test_garbage_is_dropped_and_the_desk_keeps_serving(desk):
    desk, client, events = desk
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(desk.address)
    try:
        raw.send(b"\xc1 not msgpack")
        raw.send_multipart([b"two", b"frames"])
        raw.send(b"\x82\xa5piece\x90\xa5stage\xa5admit")  # a map with the right keys and wrong values
        deadline = time.monotonic() + 10
        while sum(desk.drops.snapshot().values()) < 3:
            assert time.monotonic() < deadline, desk.drops.snapshot()
            time.sleep(0.01)
    finally:
        raw.close(linger=0)
    client.admit(KvPiece("live", 1, 0, 1, (3,)))
    assert events.empty()
