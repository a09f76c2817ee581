"""Real zmq sockets (ipc and tcp) between a sender and a receiver thread in this process."""

from __future__ import annotations

import os
import socket
import threading
import time

import msgpack
import pytest
import ray.util
import torch

from kv_transfer.page_format import PageFormatError, TransferError, encode_header
from kv_transfer.zmq_transport import _MAX_SOCKETS, ZmqKVSender
from tests.kv_transfer import WAIT_S, apply_transfer, bit_equal, clone_caches, header_for, make_caches
from tests.helpers.sockets import raw_push

# staged: the page frames are received into buffers of our own, as for a CUDA cache (pinned there).
@pytest.mark.parametrize("staged", [False, True], ids=["frames", "staged"])
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pages_arrive_bit_identical(make_receiver, sender, transport, dtype, staged):
    src = make_caches(dtype, seed=1)
    recv = make_receiver(make_caches(dtype, seed=2), transport, staged=staged)
    before = clone_caches(recv.caches)
    header = header_for(src, [7, 2, 12], "t1", note=b"\x03\x01\x04")

    sender.send(recv.rx.endpoint, header, src, [5, 1, 9], timeout_s=5.0)

    assert recv.next_event() == ("ok", header)
    assert bit_equal(recv.caches, apply_transfer(before, src, [5, 1, 9], [7, 2, 12]))  # other blocks untouched
    spec = header.spec
    assert recv.rx.stats().transfers_ok == 1 and recv.rx.stats().transfers_refused == 0
    assert recv.rx.stats().bytes_received == 2 * spec.num_layers * 3 * spec.page_nbytes
    assert recv.rx.endpoint.startswith(f"{transport}://")


@pytest.mark.parametrize("dtype, head_dim", [(torch.float16, 3), (torch.float8_e4m3fn, 3), (torch.float32, 1)])
def test_odd_page_sizes(make_receiver, sender, dtype, head_dim):
    """Pages of 6, 3 and 4 bytes: copied as 2-byte, 1-byte and 4-byte words."""
    layout = dict(block_size=1, num_kv_heads=1, head_dim=head_dim)
    src = make_caches(dtype, seed=1, **layout)
    recv = make_receiver(make_caches(dtype, seed=2, **layout))
    before = clone_caches(recv.caches)
    header = header_for(src, [15, 0, 8])
    sender.send(recv.rx.endpoint, header, src, [3, 14, 2], timeout_s=5.0)
    assert recv.next_event() == ("ok", header)
    assert bit_equal(recv.caches, apply_transfer(before, src, [3, 14, 2], [15, 0, 8]))


def test_on_complete_runs_after_the_write(make_receiver, sender):
    src = make_caches(seed=1)
    seen = []
    recv = make_receiver(make_caches(seed=2), on_complete=lambda h: seen.append(
        [torch.equal(recv.caches[layer][i][3], src[layer][i][0]) for layer in range(2) for i in range(2)]))
    sender.send(recv.rx.endpoint, header_for(src, [3]), src, [0], timeout_s=5.0)
    deadline = time.monotonic() + WAIT_S
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [[True, True, True, True]]


def test_sender_reuses_one_socket_per_endpoint(make_receiver, sender):
    src = make_caches(seed=1)
    a, b = make_receiver(make_caches(seed=2)), make_receiver(make_caches(seed=3), "tcp")
    for i in range(3):
        sender.send(a.rx.endpoint, header_for(src, [i], f"a{i}"), src, [i], timeout_s=5.0)
        sender.send(b.rx.endpoint, header_for(src, [i], f"b{i}"), src, [i], timeout_s=5.0)
    assert sender.open_endpoints == (a.rx.endpoint, b.rx.endpoint)
    assert [a.next_event()[1].transfer_id for _ in range(3)] == ["a0", "a1", "a2"]
    assert [b.next_event()[1].transfer_id for _ in range(3)] == ["b0", "b1", "b2"]


def test_sockets_to_endpoints_no_longer_used_are_closed_past_the_cap(make_receiver, sender, tmp_path):
    """A restarted receiver listens at a new endpoint; the sender closes the socket unused longest once it
    keeps _MAX_SOCKETS, instead of one per receiver it ever sent to (each reconnecting to a dead address)."""
    src = make_caches(seed=1)
    live = make_receiver(make_caches(seed=2))
    sender.send(live.rx.endpoint, header_for(src, [0], "first"), src, [0], timeout_s=5.0)
    gone = [f"ipc://{tmp_path}/gone-{i}" for i in range(_MAX_SOCKETS)]  # peers since restarted elsewhere
    for endpoint in gone:
        sender._socket(endpoint)
    assert sender.open_endpoints == tuple(gone)  # the live one was unused longest: closed
    sender.send(live.rx.endpoint, header_for(src, [1], "again"), src, [1], timeout_s=5.0)  # a new socket
    assert [live.next_event()[1].transfer_id for _ in range(2)] == ["first", "again"]
    assert len(sender.open_endpoints) == _MAX_SOCKETS and sender.open_endpoints[-1] == live.rx.endpoint


def test_concurrent_senders(make_receiver):
    recv = make_receiver(make_caches(seed=2), "tcp")
    expected = clone_caches(recv.caches)
    jobs = []  # (sender caches, src ids, dest ids): each sender its own dest blocks
    for n in range(4):
        src = make_caches(seed=10 + n)
        jobs.append((src, [n, 15 - n, 7], [4 * n + 2, 4 * n, 4 * n + 1]))
        expected = apply_transfer(expected, src, jobs[-1][1], jobs[-1][2])
    errors = []

    def push(n, src, src_ids, dest_ids):
        s = ZmqKVSender()
        try:
            for rep in range(3):  # the same pages thrice: interleaved messages would show as refusals
                s.send(recv.rx.endpoint, header_for(src, dest_ids, f"s{n}-{rep}"), src, src_ids, timeout_s=5.0)
        except Exception as e:
            errors.append(e)
        finally:
            s.close()

    threads = [threading.Thread(target=push, args=(n, *job)) for n, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert errors == [] and not [t for t in threads if t.is_alive()], errors
    events = [recv.next_event() for _ in range(12)]
    assert sorted(e[1].transfer_id for e in events) == sorted(f"s{n}-{r}" for n in range(4) for r in range(3))
    assert {e[0] for e in events} == {"ok"}
    assert bit_equal(recv.caches, expected)


@pytest.mark.parametrize("field, sender_kw, words", [
    ("dtype", dict(dtype=torch.bfloat16), "sender dtype=bfloat16, receiver dtype=float32"),
    ("head_dim", dict(head_dim=16), "sender head_dim=16, receiver head_dim=8"),
    ("block_size", dict(block_size=8), "sender block_size=8, receiver block_size=4"),
    ("num_layers", dict(num_layers=3), "sender num_layers=3, receiver num_layers=2"),
])
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_mismatch_is_refused_and_receiver_keeps_serving(make_receiver, sender, transport, field, sender_kw, words):
    recv = make_receiver(make_caches(seed=2), transport)
    before = clone_caches(recv.caches)
    bad_src = make_caches(seed=1, **sender_kw)
    bad = header_for(bad_src, [7, 2], "bad")

    sender.send(recv.rx.endpoint, bad, bad_src, [5, 1], timeout_s=5.0)  # the sender cannot know; the ack says

    kind, header, exc = recv.next_event()
    assert (kind, header) == ("error", bad)
    assert isinstance(exc, PageFormatError) and words in str(exc)
    assert bit_equal(recv.caches, before)
    assert (recv.rx.stats().transfers_ok, recv.rx.stats().transfers_refused) == (0, 1)

    good_src = make_caches(seed=3)
    good = header_for(good_src, [7, 2], "good")
    sender.send(recv.rx.endpoint, good, good_src, [5, 1], timeout_s=5.0)
    assert recv.next_event() == ("ok", good)
    assert bit_equal(recv.caches, apply_transfer(before, good_src, [5, 1], [7, 2]))


@pytest.mark.parametrize("staged", [False, True], ids=["frames", "staged"])
def test_malformed_messages_write_nothing(make_receiver, sender, staged):
    recv = make_receiver(make_caches(seed=2), staged=staged)
    before = clone_caches(recv.caches)
    src = make_caches(seed=1)
    header = header_for(src, [7, 2], "short")
    page = bytes(2 * header.spec.page_nbytes)
    bad_messages = [
        [b"\xc1junk", page, page, page, page],  # header is not msgpack
        [msgpack.packb({"v": 99})] + [page] * 4,  # unknown version
        [encode_header(header), page, page, page],  # a frame missing
        [encode_header(header), page, page, page, page[:-1]],  # a frame short by one byte
        [encode_header(header), page, page + b"x", page, page],  # a frame long by one byte
        [encode_header(header_for(src, [7, 16], "oob"))] + [page] * 4,  # dest block outside the pool
        [encode_header(header_for(src, [7, 7], "dup"))] + [page] * 4,  # dest block twice
    ]
    raw_push(recv.rx.endpoint, bad_messages)
    events = [recv.next_event() for _ in bad_messages]
    assert [(e[0], e[1] and e[1].transfer_id) for e in events] == [
        ("error", None), ("error", None), ("error", "short"), ("error", "short"), ("error", "short"),
        ("error", "oob"), ("error", "dup")]
    messages = [str(e[2]) for e in events]
    assert "not msgpack" in messages[0] and "version 99" in messages[1]
    assert "expected 4 page payloads of 512 bytes, got 3 of sizes [512]" in messages[2]
    assert "got 4 of sizes [511, 512]" in messages[3]
    assert "got 4 of sizes [512, 513]" in messages[4]
    assert "dest block ids [16] outside the receiver's pool [0, 16)" in messages[5]
    assert "repeat" in messages[6]
    assert bit_equal(recv.caches, before)
    assert recv.rx.stats().transfers_refused == 7
    assert recv.rx.drops.snapshot() == {"malformed": 2, "refused": 5}

    sender.send(recv.rx.endpoint, header, src, [0, 1], timeout_s=5.0)
    assert recv.next_event() == ("ok", header)


def test_admit_hook_runs_after_format_checks_and_can_refuse(make_receiver, sender):
    asked = []

    def admit(header):
        asked.append(header.transfer_id)
        if header.lease_id == "lease-expired":
            raise PageFormatError(f"transfer {header.transfer_id}: lease expired")

    recv = make_receiver(make_caches(seed=2), admit=admit)
    before = clone_caches(recv.caches)
    src, bad_src = make_caches(seed=1), make_caches(seed=1, head_dim=16)
    sender.send(recv.rx.endpoint, header_for(bad_src, [3], "mismatch"), bad_src, [0], timeout_s=5.0)
    sender.send(recv.rx.endpoint, header_for(src, [3], "expired"), src, [0], timeout_s=5.0)
    sender.send(recv.rx.endpoint, header_for(src, [4], "live"), src, [1], timeout_s=5.0)
    events = [recv.next_event() for _ in range(3)]
    assert [(e[0], e[1].transfer_id) for e in events] == [("error", "mismatch"), ("error", "expired"), ("ok", "live")]
    assert str(events[1][2]) == "transfer expired: lease expired"
    assert asked == ["expired", "live"]  # never asked about a transfer that fails the format checks
    assert bit_equal(recv.caches, apply_transfer(before, src, [1], [4]))


def test_callback_exception_does_not_stop_receiver(make_receiver, sender):
    calls = []

    def boom(header):
        calls.append(header.transfer_id)
        raise RuntimeError("callback bug")

    recv = make_receiver(make_caches(seed=2), on_complete=boom)
    src = make_caches(seed=1)
    for i in range(2):
        sender.send(recv.rx.endpoint, header_for(src, [i], f"t{i}"), src, [i], timeout_s=5.0)
    deadline = time.monotonic() + WAIT_S
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls == ["t0", "t1"]


def test_send_validates_before_sending(sender):
    src = make_caches(seed=1)
    with pytest.raises(PageFormatError, match="does not describe the caches"):
        sender.send("ipc:///nonexistent", header_for(make_caches(head_dim=4), [1]), src, [1], timeout_s=1.0)
    with pytest.raises(PageFormatError, match="2 source blocks but 1 destination blocks"):
        sender.send("ipc:///nonexistent", header_for(src, [1]), src, [1, 2], timeout_s=1.0)
    with pytest.raises(PageFormatError, match=r"source block ids \[16\] outside the sender's pool \[0, 16\)"):
        sender.send("ipc:///nonexistent", header_for(src, [1]), src, [16], timeout_s=1.0)
    assert sender.open_endpoints == ()


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_send_to_dead_endpoint_times_out(make_receiver, sender, transport):
    recv = make_receiver(make_caches(seed=2), transport)
    endpoint = recv.rx.endpoint
    recv.rx.close()  # nobody listens there any more (and the ipc file is gone)
    if transport == "tcp":
        # A freed tcp port may be taken by any process of a busy machine at once: hold one, bound but
        # not listening, so that it surely refuses.
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{held.getsockname()[1]}"
    src = make_caches(seed=1)
    start = time.monotonic()
    with pytest.raises(TransferError, match=f"no receiver at {endpoint}"):
        sender.send(endpoint, header_for(src, [1]), src, [1], timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert 1.0 <= elapsed < 1.0 + WAIT_S  # never before its deadline, never a hang (how late: a timing, not a test)
    assert sender.open_endpoints == ()  # the failed socket is dropped, the next send starts fresh
    if transport == "tcp":
        held.close()


def test_wildcard_bind_advertises_a_reachable_host(make_receiver, sender):
    """Bound to every interface, the endpoint names this node's IP (what other machines connect to)."""
    recv = make_receiver(make_caches(seed=2), "tcp", host="0.0.0.0")
    assert recv.rx.endpoint.startswith(f"tcp://{ray.util.get_node_ip_address()}:")
    src = make_caches(seed=1)
    header = header_for(src, [3])
    sender.send(recv.rx.endpoint, header, src, [0], timeout_s=5.0)
    assert recv.next_event() == ("ok", header)


def test_close_stops_the_receiving_thread_and_is_idempotent(make_receiver):
    """close() waits for the receiving loop to end (it sees the stop at its next poll) rather than leaving it
    running past the join's own 5 s bound; how soon is a timing, not asserted."""
    recv = make_receiver(make_caches(seed=2))
    path = recv.rx.endpoint.removeprefix("ipc://")
    assert os.path.exists(path) and recv.rx.alive
    recv.rx.close()
    assert not recv.rx.alive  # the loop ended: close did not give up on it
    assert not os.path.exists(path)
    recv.rx.close()
