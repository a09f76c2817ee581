"""KV pages through shared memory between a sender and an ipc receiver of this host: the bytes land in the
right blocks, lanes are reused and replaced, concurrent senders each get their own lane, and every other
case (tcp, a switch turned off, a receiver of another host identity) still sends the pages as frames."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kv_transfer.page_format import HeadSlice, PageSpec, TransferHeader
from kv_transfer.shm_pages import IDENTITY_FILE
from kv_transfer.shm_segment import PREFIX, SHM_DIR
from kv_transfer.zmq_transport import ZmqKVSender
from tests.kv_transfer import WAIT_S, apply_transfer, bit_equal, clone_caches, header_for, make_caches


def own_segments(pid: int | None = None) -> list[str]:
    """Names in /dev/shm of segments made by process `pid` (this one by default)."""
    pid = str(pid or os.getpid())
    return [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX) and n[len(PREFIX):].split("-")[1:2] == [pid]]


@pytest.mark.parametrize("staged", [False, True], ids=["frames", "staged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_pages_arrive_bit_identical_through_shared_memory(make_receiver, sender, dtype, staged):
    src = make_caches(dtype, seed=1)
    recv = make_receiver(make_caches(dtype, seed=2), staged=staged)
    before = clone_caches(recv.caches)
    header = header_for(src, [7, 2, 12], "t1", note=b"\x03\x01")

    sender.send(recv.rx.endpoint, header, src, [5, 1, 9], timeout_s=5.0)

    assert recv.next_event() == ("ok", header)
    assert bit_equal(recv.caches, apply_transfer(before, src, [5, 1, 9], [7, 2, 12]))  # other blocks untouched
    assert sender.shm_endpoints == (recv.rx.endpoint,) and recv.rx.shm_lanes == 1
    assert recv.rx.stats().bytes_received == header.spec.transfer_nbytes(3)
    assert own_segments() == []  # the receiver removed the name when it mapped the lane
    assert recv.rx.drops.snapshot() == {}


def test_odd_page_sizes_through_shared_memory(make_receiver, sender):
    """3-byte pages (float8, one head of 3 dims): spans stay aligned, pages are copied as bytes."""
    layout = dict(block_size=1, num_kv_heads=1, head_dim=3)
    src = make_caches(torch.float8_e4m3fn, seed=1, **layout)
    recv = make_receiver(make_caches(torch.float8_e4m3fn, seed=2, **layout))
    before = clone_caches(recv.caches)
    for i, (s, d) in enumerate([([3, 14, 2], [15, 0, 8]), ([1], [4]), ([0, 5], [9, 10])]):
        header = header_for(src, d, f"t{i}")
        sender.send(recv.rx.endpoint, header, src, s, timeout_s=5.0)
        assert recv.next_event() == ("ok", header)
        before = apply_transfer(before, src, s, d)
    assert bit_equal(recv.caches, before) and sender.shm_endpoints == (recv.rx.endpoint,)


def test_head_slices_through_shared_memory(make_receiver, sender):
    """A sender holding heads [0, 4) sends heads [2, 4) to a receiver holding [2, 4): only those land."""
    src = make_caches(num_kv_heads=4, seed=1)
    mine = HeadSlice(2, 2, 4)
    recv = make_receiver(make_caches(num_kv_heads=2, seed=2), heads=mine)
    spec = PageSpec.from_caches(src)
    spec = PageSpec(spec.dtype, spec.block_size, spec.num_layers, 2, spec.head_dim)
    header = TransferHeader("t", "lease", spec, (6, 0), b"", mine)
    sender.send(recv.rx.endpoint, header, src, [3, 1], 5.0, cache_heads=HeadSlice.whole(4))
    assert recv.next_event() == ("ok", header)
    for (k, v), (sk, sv) in zip(recv.caches, src):
        for got, want in ((k, sk), (v, sv)):
            assert torch.equal(got[[6, 0]].view(torch.uint8), want[[3, 1], :, 2:4].contiguous().view(torch.uint8))
    assert sender.shm_endpoints == (recv.rx.endpoint,)


def test_a_small_lane_is_reused_and_a_larger_transfer_replaces_it(make_receiver):
    """A lane with room for one 2-block transfer: each send waits for the last span to be released, and
    every transfer still lands exactly; a 6-block transfer gets a new, larger lane."""
    src = make_caches(seed=1)
    recv = make_receiver(make_caches(seed=2))
    expected = clone_caches(recv.caches)
    nbytes = header_for(src, [0, 1]).spec.transfer_nbytes(2)
    sender = ZmqKVSender(shm_lane_bytes=nbytes)
    try:
        for i in range(12):
            s, d = [i % 16, (5 * i + 3) % 16], [(3 * i) % 16, (3 * i + 1) % 16]
            header = header_for(src, d, f"t{i}")
            sender.send(recv.rx.endpoint, header, src, s, timeout_s=5.0)
            expected = apply_transfer(expected, src, s, d)
        header = header_for(src, list(range(10, 16)), "big")
        sender.send(recv.rx.endpoint, header, src, list(range(6)), timeout_s=5.0)
        expected = apply_transfer(expected, src, list(range(6)), list(range(10, 16)))
        events = [recv.next_event() for _ in range(13)]
    finally:
        sender.close()
    assert [e[1].transfer_id for e in events] == [f"t{i}" for i in range(12)] + ["big"]
    assert {e[0] for e in events} == {"ok"}
    assert bit_equal(recv.caches, expected)


def test_concurrent_senders_each_get_a_lane(make_receiver):
    recv = make_receiver(make_caches(seed=2))
    expected = clone_caches(recv.caches)
    jobs = []  # (sender caches, src ids, dest ids): each sender its own dest blocks
    for n in range(4):
        src = make_caches(seed=10 + n)
        jobs.append((src, [n, 15 - n, 7], [4 * n + 2, 4 * n, 4 * n + 1]))
        expected = apply_transfer(expected, src, jobs[-1][1], jobs[-1][2])
    errors, lanes = [], []

    def push(n, src, src_ids, dest_ids):
        s = ZmqKVSender()
        try:
            for rep in range(5):  # the same pages again and again: a torn or misplaced span would show
                s.send(recv.rx.endpoint, header_for(src, dest_ids, f"s{n}-{rep}"), src, src_ids, timeout_s=5.0)
            lanes.append(s.shm_endpoints)
        except Exception as e:
            errors.append(e)
        finally:
            s.close()

    threads = [threading.Thread(target=push, args=(n, *job)) for n, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert errors == []
    events = [recv.next_event() for _ in range(20)]
    assert sorted(e[1].transfer_id for e in events) == sorted(f"s{n}-{r}" for n in range(4) for r in range(5))
    assert {e[0] for e in events} == {"ok"}
    assert lanes == [(recv.rx.endpoint,)] * 4
    assert bit_equal(recv.caches, expected)
    assert recv.rx.drops.snapshot() == {}


@pytest.mark.parametrize("where", ["tcp", "receiver off", "sender off", "other host"])
def test_pages_go_as_frames_without_a_shared_host(make_receiver, where):
    """tcp (across hosts: unchanged), either end's switch off, or a receiver whose host identity is not
    ours (a container with its own /dev/shm): the pages travel on the socket, and still land exactly."""
    src = make_caches(seed=1)
    recv = make_receiver(make_caches(seed=2), "tcp" if where == "tcp" else "ipc", shm=where != "receiver off")
    if where == "other host":
        path = os.path.join(os.path.dirname(recv.rx.endpoint.removeprefix("ipc://")), IDENTITY_FILE)
        with open(path, "w") as f:
            f.write("another-boot-id 27 1 0")
    before = clone_caches(recv.caches)
    sender = ZmqKVSender(shm=where != "sender off")
    try:
        header = header_for(src, [7, 2], "t")
        sender.send(recv.rx.endpoint, header, src, [5, 1], timeout_s=5.0)
        assert recv.next_event() == ("ok", header)
        assert sender.shm_endpoints == () and recv.rx.shm_lanes == 0
        assert own_segments() == []
    finally:
        sender.close()
    assert bit_equal(recv.caches, apply_transfer(before, src, [5, 1], [7, 2]))


def test_closing_leaves_no_segment(make_receiver):
    """A lane its receiver never opened (the receiver is busy) is removed by the sender's close; the note
    that arrives afterwards is refused and counted, and the receiver goes on."""
    src = make_caches(seed=1)
    hold, held = threading.Event(), threading.Event()

    def on_complete(header):
        recv.events.put(("ok", header))
        if header.transfer_id == "first":
            held.set()
            hold.wait(WAIT_S)

    recv = make_receiver(make_caches(seed=2), on_complete=on_complete)
    a, b = ZmqKVSender(), ZmqKVSender(close_linger_s=0.2)
    try:
        a.send(recv.rx.endpoint, header_for(src, [1], "first"), src, [1], timeout_s=5.0)
        assert held.wait(WAIT_S)  # the receiving thread is inside the first transfer's callback
        b.send(recv.rx.endpoint, header_for(src, [2], "late"), src, [2], timeout_s=5.0)
        assert len(own_segments()) == 1  # b's lane: created, not opened yet
        b.close()
        assert own_segments() == []
    finally:
        hold.set()
        a.close()
        b.close()
    assert recv.next_event()[:2] == ("ok", header_for(src, [1], "first"))
    kind, header, exc = recv.next_event()
    assert (kind, header.transfer_id) == ("error", "late") and "No such file" in str(exc)
    assert recv.rx.drops.snapshot() == {"refused": 1}
    recv.rx.close()
    assert recv.rx.shm_lanes == 0 and own_segments() == []
