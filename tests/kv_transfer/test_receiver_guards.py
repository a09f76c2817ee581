"""A KV receiver open to the network: only holders of the cluster's keys get a transfer in, and nothing a
peer sends (oversized frames, too many frames, a header claiming more blocks than the pool, raw bytes)
allocates for it, writes a block or stops the receiving thread. Each drop is counted by reason. And
what a killed receiver leaves behind (its ipc directory) is cleaned up by the next one."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time

import pytest

from kv_transfer.curve import CurveKeys, rejected_handshakes
from kv_transfer.page_format import TransferError, encode_header
from kv_transfer.zmq_transport import ZmqKVSender
from tests.kv_transfer import WAIT_S, apply_transfer, bit_equal, clone_caches, header_for, make_caches
from tests.helpers.sockets import offer, raw_push, stranger


def _host_port(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def _until_closed(conn: socket.socket) -> None:
    """Reads until the peer closes the connection (an end of stream or a reset); fails if it never does."""
    try:
        while conn.recv(4096):
            pass
    except ConnectionResetError:
        pass  # closed with our bytes unread: as much an answer as an end of stream
    except TimeoutError:
        raise AssertionError(f"the receiver kept the connection open for {conn.gettimeout()} s") from None


def test_only_holders_of_the_cluster_keys_get_a_transfer_in(make_receiver):
    keys = CurveKeys.generate()
    recv = make_receiver(make_caches(seed=2), transport="tcp", keys=keys)
    before = clone_caches(recv.caches)
    src = make_caches(seed=1)
    refused_before = rejected_handshakes()
    plain = ZmqKVSender()  # no CURVE at all
    try:
        with pytest.raises(TransferError, match="no receiver"):
            plain.send(recv.rx.endpoint, header_for(src, [3], "forged"), src, [0], timeout_s=1.0)
    finally:
        plain.close()
    # One that knows the server's public key (public keys are no secret) but holds a pair of its own.
    with stranger(recv.rx.endpoint, keys.public) as sock:
        header = header_for(src, [3], "forged")
        offer(sock, encode_header(header), *[bytes(header.spec.page_nbytes)] * 4)
        deadline = time.monotonic() + 10
        while rejected_handshakes() == refused_before and time.monotonic() < deadline:
            time.sleep(0.05)
    assert rejected_handshakes() > refused_before  # the ZAP check refused its key
    with socket.create_connection(_host_port(recv.rx.endpoint), timeout=WAIT_S) as raw:  # not even zmq: bytes
        raw.sendall(b"\xc1 not a handshake" * 64)
        _until_closed(raw)  # zmq read them and refused the peer: the loop below never saw them

    member = ZmqKVSender(keys=keys)
    try:
        header = header_for(src, [5], "member")
        member.send(recv.rx.endpoint, header, src, [2], timeout_s=5.0)
        assert recv.next_event() == ("ok", header)
    finally:
        member.close()
    assert recv.events.empty()
    assert bit_equal(recv.caches, apply_transfer(before, src, [2], [5]))
    assert recv.rx.drops.snapshot() == {} and recv.rx.alive


@pytest.mark.parametrize("staged", [False, True], ids=["frames", "staged"])
def test_hostile_messages_are_dropped_and_counted(make_receiver, sender, staged):
    caches = make_caches(seed=2)
    recv = make_receiver(caches, staged=staged)
    before = clone_caches(recv.caches)
    src = make_caches(seed=1)
    header = header_for(src, [7, 2], "h")
    page = bytes(2 * header.spec.page_nbytes)
    huge = header_for(src, list(range(100_000)), "huge")  # 100k blocks of a 16-block pool: 51 MB a frame
    raw_push(recv.rx.endpoint, [
        [encode_header(header)] + [page] * 4 + [page] * 96,  # 100 page frames where 4 belong
        [encode_header(huge)] + [page] * 4,
        [b"\x00" * (recv.rx.max_frame_bytes + 1)],  # over MAXMSGSIZE: zmq drops the peer, nothing arrives
    ])
    events = [recv.next_event() for _ in range(2)]
    assert [(e[0], e[1].transfer_id) for e in events] == [("error", "h"), ("error", "huge")]
    assert "expected 4 page payloads" in str(events[0][2])
    assert "outside the receiver's pool [0, 16)" in str(events[1][2])

    sender.send(recv.rx.endpoint, header, src, [0, 1], timeout_s=5.0)
    assert recv.next_event() == ("ok", header)
    assert recv.events.empty()  # the oversized frame never reached the loop
    assert bit_equal(recv.caches, apply_transfer(before, src, [0, 1], [7, 2]))
    assert recv.rx.drops.snapshot() == {"refused": 2}
    assert recv.rx.alive


def test_a_dead_receiving_thread_shows(make_receiver):
    recv = make_receiver(make_caches())
    assert recv.rx.alive
    recv.rx.close()
    assert not recv.rx.alive


def test_socket_dirs_of_dead_receivers_are_removed_at_start(make_receiver):
    """A receiver killed without `close` leaves its ipc directory behind; the next one to start in any
    process removes it, and leaves the directories of live processes alone."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that is gone now
    stale = tempfile.mkdtemp(prefix=f"tandem-kv-{dead.pid}-")
    live = tempfile.mkdtemp(prefix=f"tandem-kv-{os.getpid()}-")
    try:
        make_receiver(make_caches())
        assert not os.path.exists(stale) and os.path.isdir(live)
    finally:
        os.rmdir(live)
