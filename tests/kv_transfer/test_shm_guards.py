"""The shared-memory path under attack and failure: forged or garbage notes are refused and counted and
never read outside the segment they name; a killed sender leaves no segment behind; a receiver that dies
mid-copy never blocks its sender past the send's deadline."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import time

import msgpack
import pytest
import torch

from kv_transfer.page_copy import gather_transfer_into
from kv_transfer.page_format import TransferError, encode_header
from kv_transfer.shm_pages import NOTE_MAGIC, ShmNote, encode_note
from kv_transfer.shm_segment import DONE, SHM_DIR, Segment, new_name, sweep_stale
from kv_transfer.zmq_transport import ZmqKVReceiver, ZmqKVSender
from tests.helpers.sockets import raw_push
from tests.kv_transfer import WAIT_S, apply_transfer, bit_equal, clone_caches, header_for, make_caches
from tests.kv_transfer.test_shm_pages import own_segments


def handmade_note(seg: Segment, src, header, src_ids, seq: int, offset: int = 0) -> ShmNote:
    """What a sender does: the pages gathered into a span of `seg`, and the note naming it."""
    page_bytes = header.num_blocks * header.spec.page_nbytes
    gather_transfer_into(src, torch.tensor(src_ids), seg.data[offset:offset + 2 * len(src) * page_bytes])
    return ShmNote(seg.name, seq, offset, page_bytes, 2 * len(src))


def wait_until(predicate, what: str):
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def segments():
    """Segments made here, as a sender would; closed afterwards."""
    made = []
    yield lambda: made.append(Segment.create(1 << 20)) or made[-1]
    for seg in made:
        seg.close()


@pytest.fixture
def planted():
    """Files planted in /dev/shm under tandem names; removed afterwards."""
    paths = []

    def plant(make) -> str:
        name = new_name()
        paths.append(os.path.join(SHM_DIR, name))
        make(paths[-1])
        return name

    yield plant
    for p in paths:
        if os.path.lexists(p):
            os.unlink(p)


def test_forged_notes_are_refused_counted_and_read_nothing(make_receiver, segments, planted):
    recv = make_receiver(make_caches(seed=2))
    before = clone_caches(recv.caches)
    src = make_caches(seed=1)
    header = header_for(src, [7, 2], "f")
    hb = encode_header(header)
    lane, other_user_mode = segments(), segments()
    os.chmod(os.path.join(SHM_DIR, other_user_mode.name), 0o644)
    symlink = planted(lambda p: os.symlink(os.path.join(SHM_DIR, other_user_mode.name), p))
    garbage = planted(lambda p: os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o600)) or os.truncate(p, 8192))
    good = handmade_note(lane, src, header, [5, 1], seq=1)
    pb, pages = good.page_bytes, good.pages

    seqs = iter(range(1, 100))

    def note(**kw):
        fields = dict(lane=lane.name, seq=next(seqs), offset=0, page_bytes=pb, pages=pages) | kw
        return [encode_note(ShmNote(**fields)), hb]

    cases = [  # (frames, words of the refusal)
        ([NOTE_MAGIC + b"\xc1junk", hb], "malformed shared-memory note"),
        ([NOTE_MAGIC + msgpack.packb([1, lane.name, -1, 0, pb, pages]), hb], "malformed shared-memory note"),
        (note(lane="../../../etc/passwd"), "is not a tandem segment name"),
        (note(lane=new_name()), "No such file"),
        (note(lane=other_user_mode.name), "not a private segment of this user"),
        (note(lane=symlink), "symbolic links"),
        (note(lane=garbage), "bad control block"),
        (note(offset=lane.capacity), "is not in the"),  # past the end of the segment
        (note(offset=lane.capacity - 4096, page_bytes=4096), "is not in the"),  # runs past it
        (note(offset=1 << 62), "is not in the"),
        (note(offset=64), "is not in the"),  # not where any span starts
        (note(pages=1000, page_bytes=1), "expected 4 page payloads of 512 bytes, got 5 of sizes [1]"),
        (note(page_bytes=pb + 1), "expected 4 page payloads of 512 bytes"),  # the header's own check
        (note(seq=1), "already served"),  # a replay
        ([encode_note(good)], "with 0 frames after it"),
        ([encode_note(good), hb, b"x"], "with 2 frames after it"),
    ]
    raw_push(recv.rx.endpoint, [frames for frames, _ in cases])
    events = [recv.next_event() for _ in cases]
    for (kind, got, exc), (frames, words) in zip(events, cases):
        assert kind == "error" and words in str(exc), (frames, exc)
        assert got == (header if len(frames) > 1 else None)
    assert bit_equal(recv.caches, before) and recv.rx.alive
    assert recv.rx.drops.snapshot() == {"refused": len(cases) - 1, "malformed": 1}
    # Released to the sender: the notes that named a real span (seq 10 and 11, both of a wrong size), not
    # the replay of seq 1 after them.
    assert lane.word(DONE) == 11

    raw_push(recv.rx.endpoint, [[encode_note(dataclasses.replace(good, seq=20)), hb]])
    assert recv.next_event() == ("ok", header)
    assert bit_equal(recv.caches, apply_transfer(before, src, [5, 1], [7, 2]))
    wait_until(lambda: lane.word(DONE) == 20, "the span to be released (right after on_complete)")


def test_a_tcp_receiver_takes_no_note(make_receiver):
    """Notes are for one host and one user: a tcp socket (reachable from other hosts) refuses them."""
    recv = make_receiver(make_caches(seed=2), "tcp")
    src = make_caches(seed=1)
    header = header_for(src, [7, 2], "f")
    lane = Segment.create(1 << 20)
    try:
        raw_push(recv.rx.endpoint, [[encode_note(handmade_note(lane, src, header, [5, 1], 1)), encode_header(header)]])
        kind, got, exc = recv.next_event()
    finally:
        lane.close()
    assert (kind, got) == ("error", header) and "offers none" in str(exc)
    assert recv.rx.drops.snapshot() == {"refused": 1} and recv.rx.shm_lanes == 0


def _sender_main(endpoint: str, names, how: str) -> None:
    torch.set_num_threads(1)
    src = make_caches(seed=1)
    if how == "sent":
        sender = ZmqKVSender()
        sender.send(endpoint, header_for(src, [3], "child"), src, [0], timeout_s=WAIT_S)
        names.put("sent")
    else:  # a lane made, and killed before any note named it
        names.put(Segment.create(1 << 20).name)
    time.sleep(600)


def _receiver_main(endpoints, admitted) -> None:
    def stuck(header):
        admitted.put(header.transfer_id)
        time.sleep(600)

    rx = ZmqKVReceiver(make_caches(seed=2), lambda h: None, lambda h, e: None, admit=stuck)
    rx.start()
    endpoints.put(rx.endpoint)
    time.sleep(600)


def test_a_killed_sender_leaves_no_segment(make_receiver):
    recv = make_receiver(make_caches(seed=2))
    ctx = mp.get_context("spawn")
    names = ctx.Queue()
    child = ctx.Process(target=_sender_main, args=(recv.rx.endpoint, names, "sent"), daemon=True)
    child.start()
    try:
        assert names.get(timeout=60) == "sent"
        assert recv.next_event()[:2] == ("ok", header_for(make_caches(seed=1), [3], "child"))
        assert recv.rx.shm_lanes == 1
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(WAIT_S)
    assert own_segments(child.pid) == []  # the receiver removed the name when it mapped the lane
    wait_until(lambda: recv.rx.shm_lanes == 0, "the receiver to unmap the dead sender's lane")

    names = ctx.Queue()  # not the last one: a process killed right after a put may still hold its lock
    child = ctx.Process(target=_sender_main, args=(recv.rx.endpoint, names, "made"), daemon=True)
    child.start()
    name = names.get(timeout=60)
    assert own_segments(child.pid) == [name]  # no receiver heard of it; its creator lives: nobody removes it
    os.kill(child.pid, signal.SIGKILL)
    child.join(WAIT_S)
    sweep_stale()  # what every receiver runs at start and every few seconds (one may have been first)
    assert own_segments(child.pid) == []


def test_a_receiver_dead_mid_copy_does_not_block_the_sender():
    """The receiver holds a span (stuck in the middle of a transfer), then is killed: the next send, which
    needs that span, fails by its deadline and drops the lane; nothing is left in /dev/shm."""
    ctx = mp.get_context("spawn")
    endpoints, admitted = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_receiver_main, args=(endpoints, admitted), daemon=True)
    child.start()
    src = make_caches(seed=1)
    header = header_for(src, [7, 2], "first")
    sender = ZmqKVSender(shm_lane_bytes=header.spec.transfer_nbytes(2))  # room for one transfer
    try:
        endpoint = endpoints.get(timeout=60)
        sender.send(endpoint, header, src, [5, 1], timeout_s=WAIT_S)
        assert admitted.get(timeout=WAIT_S) == "first"
        os.kill(child.pid, signal.SIGKILL)
        child.join(WAIT_S)
        with pytest.raises(TransferError):
            sender.send(endpoint, header_for(src, [3, 4], "second"), src, [0, 1], timeout_s=1.0)
        assert sender.shm_endpoints == () and own_segments() == []
    finally:
        sender.close()
        if child.is_alive():
            os.kill(child.pid, signal.SIGKILL)
