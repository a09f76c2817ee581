"""KV transfer over zmq PUSH/PULL: ipc (a socket file, one host) or tcp (across hosts).

Wire: one multipart message per transfer: the msgpack header frame, then for each layer the K pages
and the V pages as raw bytes (`2 * num_layers` frames of `num_blocks * page_nbytes` bytes each). The
sender gathers one layer at a time (`index_select` into a fresh tensor) and hands it to zmq without
copying. A multipart message is delivered whole or not at all, so concurrent senders to one receiver
never interleave and a transfer is never half written. zmq queues the frames of a message until its
last one, so gathering and wire time do not overlap within one transfer.

One host: when an ipc receiver offers shared memory and the sender shares its host and user
(`kv_transfer.shm_pages`), the sender gathers the pages into a span of a shared-memory segment instead,
and the message is [note, header]: the note (which segment, which span) and the usual header. The
receiver writes the pages from the span; everything after that (checks, admit, callbacks) is the same.
Each end has a switch (`shm=False`) that keeps the pages on the socket.

A CUDA cache is staged through pinned host memory both ways: the sender queues every layer's
device-to-host copy, waits for them once, then hands the pinned pages to zmq; the receiver reads the
page frames straight into pinned buffers sized from the header (`recv_into`) and queues the
host-to-device copies, which finish before the transfer is reported complete. A CPU cache takes
neither detour.

Security: with `keys` (`kv_transfer.curve`) both ends speak CURVE and the receiver admits only
holders of the cluster's secret; without, anyone who reaches the socket may send. Either way the
receiver takes no frame larger than the largest legitimate one (its whole pool of one layer's K or V:
zmq disconnects a peer that sends more), allocates nothing for a transfer before its header passed
every check, and counts what it drops instead of dying of it.

Limits: `send` returning means zmq has the message queued, not that the receiver got it (a receiver
that dies with messages in flight loses them; the lease's ack covers that). A receiver queues at most
`_RCV_HWM` whole transfers before senders block (and then time out). Through shared memory, a sender's
lane holds a few transfers no receiver has served yet; the next send waits for room until its deadline.

Why ~380 lines: the sender and the receiver are the two halves of one wire format (page frames, or a
shared-memory note) and its limits; apart, each would restate them. What shared memory itself takes
(segments, lanes, who releases what) lives in `shm_pages` / `shm_segment`.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from typing import Sequence

import torch
import zmq

from kv_transfer.base import Admit, KVCaches, KVReceiver, KVSender, OnComplete, OnError, logger
from kv_transfer.curve import CurveKeys, secure_client, secure_server
from kv_transfer.endpoints import advertised_host
from kv_transfer.page_copy import gather_pages, scatter_transfer
from kv_transfer.page_format import (
    HeadSlice, PageFormatError, TransferError, TransferHeader, decode_header, encode_header,
)
from kv_transfer.shm_pages import LANE_BYTES, ShmLanes, ShmLaneTable, advertise, decode_note, encode_note, is_note

_RCV_HWM = 16
_CPU = torch.device("cpu")
_DIR_PREFIX = "tandem-kv-"  # + the owner's pid + "-": ipc socket directories
_HEADER_SLACK = 1 << 20  # ids, spec and the caller's note: far under this for any real transfer


_MAX_SOCKETS = 64  # destinations a sender keeps a socket to; the one unused longest is closed past it


class ZmqKVSender(KVSender):
    """One PUSH socket per destination endpoint, created on first use and reused, at most `_MAX_SOCKETS`
    (least recently used closed first): a restarted decode worker listens at a new endpoint, and a socket
    kept for the old one would try to reconnect to it for the life of the process.

    Not thread-safe (zmq sockets are not): use a sender from one thread at a time, or one per thread.
    shm: put the pages in shared memory for receivers that offer it (one host, one user); `shm_lane_bytes`
    is how much of it one receiver's lane may hold (a larger transfer gets a lane of its own size).
    """

    def __init__(self, context: zmq.Context | None = None, close_linger_s: float = 1.0, keys: CurveKeys | None = None,
                 shm: bool = True, shm_lane_bytes: int = LANE_BYTES):
        self._ctx = context or zmq.Context.instance()
        self._keys = keys
        self._close_linger_ms = int(close_linger_s * 1000)
        self._sockets: OrderedDict[str, zmq.Socket] = OrderedDict()  # least recently used first
        self._shm = ShmLanes(shm_lane_bytes) if shm else None

    @property
    def open_endpoints(self) -> tuple[str, ...]:
        return tuple(self._sockets)

    @property
    def shm_endpoints(self) -> tuple[str, ...]:
        """Endpoints whose pages go through shared memory (a lane is open)."""
        return self._shm.endpoints if self._shm is not None else ()

    def send(self, endpoint: str, header: TransferHeader, kv_caches: KVCaches,
             src_block_ids: Sequence[int], timeout_s: float, cache_heads: HeadSlice | None = None) -> None:
        src, heads = self.check_send(header, kv_caches, src_block_ids, cache_heads)
        header_bytes = encode_header(header)
        deadline = time.monotonic() + timeout_s
        sock = self._socket(endpoint)
        try:
            note = self._shm.put(endpoint, header, kv_caches, src, heads, deadline) if self._shm else None
            # IMMEDIATE: nothing is queued for a peer that is not connected, so with nobody listening
            # the first frame waits for SNDTIMEO and fails. Once it is in, the rest of the message follows.
            sock.setsockopt(zmq.SNDTIMEO, max(0, math.ceil((deadline - time.monotonic()) * 1000)))
            if note:
                sock.send(encode_note(note), zmq.SNDMORE)
                sock.send(header_bytes)
                return
            sock.send(header_bytes, zmq.SNDMORE)
            pages = _host_pages(kv_caches, src, heads)
            for i, page in enumerate(pages):
                sock.send(page.numpy(), 0 if i == len(pages) - 1 else zmq.SNDMORE, copy=False)
        except zmq.Again:
            self._drop(endpoint)
            raise TransferError(f"transfer {header.transfer_id}: no receiver at {endpoint} took it "
                                f"within {timeout_s}s") from None
        except zmq.ZMQError as e:
            self._drop(endpoint)
            raise TransferError(f"transfer {header.transfer_id} to {endpoint} failed: {e}") from e
        except BaseException:
            self._drop(endpoint)  # a half-sent multipart message must not be completed by the next send
            raise

    def close(self) -> None:
        if self._shm is not None:  # first, while the sockets still deliver the notes in flight
            self._shm.close(linger_s=self._close_linger_ms / 1000)
        for sock in self._sockets.values():
            sock.close(linger=self._close_linger_ms)  # queued transfers still get this long to leave
        self._sockets.clear()

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self._sockets.get(endpoint)
        if sock is not None:
            self._sockets.move_to_end(endpoint)
        else:
            while len(self._sockets) >= _MAX_SOCKETS:
                _, oldest = self._sockets.popitem(last=False)
                oldest.close(linger=self._close_linger_ms)  # what it still queues gets the close's linger
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.LINGER, 0)
            secure_client(sock, self._keys)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as e:
                sock.close()
                raise TransferError(f"cannot connect to {endpoint!r}: {e}") from e
            self._sockets[endpoint] = sock
        return sock

    def _drop(self, endpoint: str) -> None:
        if self._shm is not None:
            self._shm.drop(endpoint)
        sock = self._sockets.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)


def _close_listening(sock: zmq.Socket) -> None:
    """Close a bound socket so that it refuses peers from now on.

    zmq closes a socket in its I/O thread after `close` returns; until then a tcp listener still accepts
    peers and takes their messages (a sender would believe a closed receiver got its pages). Unbinding
    and waiting for the listener's CLOSED event makes the close take effect here."""
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    if endpoint.startswith("tcp://"):
        monitor = sock.get_monitor_socket(zmq.EVENT_CLOSED)
        try:
            sock.unbind(endpoint)
            if monitor.poll(2000):
                monitor.recv_multipart()
        except zmq.ZMQError as e:
            logger.warning("closing %s: %s", endpoint, e)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
    sock.close(linger=0)


def _host_pages(kv_caches: KVCaches, src: torch.Tensor, heads: tuple[int, int] | None) -> list[torch.Tensor]:
    """Every layer's K then V pages (of `heads`, or all heads) as host byte tensors, in wire order."""
    device = kv_caches[0][0].device
    if device.type != "cuda":
        return [gather_pages(t, src, _CPU, heads=heads) for pair in kv_caches for t in pair]
    # Queue all device-to-host copies (into pinned memory), then wait once: zmq reads the host bytes.
    pages = [gather_pages(t, src, _CPU, non_blocking=True, heads=heads) for pair in kv_caches for t in pair]
    torch.cuda.current_stream(device).synchronize()
    return pages


class ZmqKVReceiver(KVReceiver):
    """A PULL socket served by one thread.

    transport="ipc": binds a socket file in a fresh temp dir (removed by `close`); endpoint "ipc://...".
    transport="tcp": binds `host` on a random port; `endpoint` advertises `advertise_host` (default:
    `host`, or this node's IP when `host` is a wildcard such as "0.0.0.0"), which must be an address
    the senders can reach.
    staged: receive page frames into host buffers of our own (pinned) before writing them into the
    cache; None means "when the cache is on CUDA". On a CPU cache it only adds a copy (tests use it).
    keys: the cluster's CURVE keys; None: an unauthenticated socket.
    shm: on ipc, offer senders of this host and user the shared-memory path (`kv_transfer.shm_pages`).
    """

    def __init__(self, kv_caches: KVCaches, on_complete: OnComplete, on_error: OnError, *,
                 transport: str = "ipc", host: str = "127.0.0.1", advertise_host: str | None = None,
                 poll_interval_s: float = 0.05, context: zmq.Context | None = None, admit: Admit | None = None,
                 staged: bool | None = None, keys: CurveKeys | None = None, heads: HeadSlice | None = None,
                 shm: bool = True):
        super().__init__(kv_caches, on_complete, on_error, admit, heads)
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        self.transport = transport
        self._host = host
        self._advertise_host = advertise_host
        self._staged = self.device.type == "cuda" if staged is None else staged
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._endpoint: str | None = None
        self._tmpdir: str | None = None
        self._keys = keys
        self._shm = shm
        self._lanes: ShmLaneTable | None = None  # the receiving thread's, once it offers shared memory
        self._max_frames = 2 * self.spec.num_layers + 1
        # The largest frame a legitimate sender sends: every block of one layer's K (or V) pages.
        self.max_frame_bytes = max(self.num_blocks * self.spec.page_nbytes, 16 * self.num_blocks + _HEADER_SLACK)

    @property
    def endpoint(self) -> str:
        if self._endpoint is None:
            raise RuntimeError("ZmqKVReceiver.endpoint is known only after start()")
        return self._endpoint

    def start(self) -> None:
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, _RCV_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        secure_server(sock, self._keys)
        if self.transport == "ipc":
            _remove_stale_socket_dirs()
            self._tmpdir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
            self._endpoint = f"ipc://{os.path.join(self._tmpdir, 'kv.sock')}"
            sock.bind(self._endpoint)
            if self._shm and advertise(self._tmpdir):
                self._lanes = ShmLaneTable(max_pages=2 * self.spec.num_layers)
        else:
            sock.bind(f"tcp://{self._host}:*")
            port = sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
            self._endpoint = f"tcp://{self._advertise_host or advertised_host(self._host)}:{port}"
        self._sock = sock  # handed to the receiving thread; only it touches the socket from now on
        self._start_thread(f"kv-recv-{self.transport}")

    def close(self) -> None:
        self._stop_thread(timeout_s=5.0)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    @property
    def shm_lanes(self) -> int:
        """Shared-memory lanes mapped now (senders on this host that sent here and are not through)."""
        return len(self._lanes) if self._lanes is not None else 0

    def _run(self) -> None:
        sock = self._sock
        try:
            while not self._stop.is_set():
                if self._lanes is not None:
                    self._lanes.sweep()
                if not sock.poll(self._poll_ms, zmq.POLLIN):
                    continue
                try:
                    first = sock.recv(copy=False).buffer
                    if is_note(first):
                        self._serve_note(sock, first)
                    elif self._staged:
                        self._serve(*self._recv_staged(sock, first))
                    else:
                        self._serve(*self._recv_frames(sock, first))
                except Exception as e:  # whatever a message did, the next one is still served
                    if not self.drops.survived(e):
                        return
                    if not isinstance(e, zmq.ZMQError):
                        _drain(sock)
        finally:
            _close_listening(sock)
            if self._lanes is not None:
                self._lanes.close()

    def _recv_frames(self, sock: zmq.Socket, head: memoryview) -> tuple[memoryview, list[int], list[memoryview]]:
        payloads = []
        while sock.getsockopt(zmq.RCVMORE) and len(payloads) < self._max_frames:
            payloads.append(sock.recv(copy=False).buffer)
        extra = _drain(sock)  # more frames than any transfer has: the size check refuses it
        return head, [len(p) for p in payloads] + [0] * extra, payloads

    def _recv_staged(self, sock: zmq.Socket, head: memoryview) -> tuple[memoryview, list[int], list]:
        """One message whose page frames land straight in fresh (pinned, for CUDA) host buffers, sized
        from the header once it passed every check; a frame of another size, or any frame after a bad
        header, is only drained (the size check then refuses the transfer)."""
        try:
            header = decode_header(head)
            self._check_header(header)
            nbytes = header.num_blocks * header.spec.page_nbytes
        except PageFormatError:
            nbytes = 0
        sizes, payloads = [], []
        while sock.getsockopt(zmq.RCVMORE):
            if nbytes and len(payloads) < self._max_frames:
                buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
                sizes.append(sock.recv_into(buf.numpy()))  # the frame's full size, even if it did not fit
                payloads.append(buf)
            else:
                sizes.append(len(sock.recv(copy=False).buffer))
        return head, sizes, payloads

    def _serve_note(self, sock: zmq.Socket, frame: memoryview) -> None:
        """[note, header]: the pages are in a span of a sender's shared-memory lane. Whatever becomes of
        the transfer, a span that was served is released to its sender."""
        rest = [sock.recv(copy=False).buffer] if sock.getsockopt(zmq.RCVMORE) else []
        extra = _drain(sock)
        try:
            if self._lanes is None:
                raise PageFormatError(f"a shared-memory note reached a receiver that offers none ({self.endpoint})")
            if len(rest) != 1 or extra:
                raise PageFormatError(f"a shared-memory note with {len(rest) + extra} frames after it, expected 1")
            note = decode_note(frame)
            payloads = self._lanes.payloads(note)
        except PageFormatError as e:
            self._refuse(_header_or_none(rest), e)
            return
        try:
            self._serve(rest[0], [len(p) for p in payloads], payloads)
        finally:
            self._lanes.release(note)

    def _serve(self, head: memoryview, sizes: list[int], payloads: list) -> None:
        """`payloads`: the page frames as byte buffers (memoryviews or uint8 tensors), `sizes` their lengths."""
        header = None
        try:
            header = decode_header(head)
            dest = self._admit(header, sizes)
        except PageFormatError as e:
            self._refuse(header, e)
            return
        try:
            scatter_transfer(self.kv_caches, dest, payloads, self._heads_of(header))
        except Exception as e:  # not expected once admitted; the dest blocks may be partly written
            self._refuse(header, TransferError(f"transfer {header.transfer_id}: writing pages failed: {e}"))
            return
        self._complete(header)


def _remove_stale_socket_dirs() -> None:
    """Socket directories of receivers whose process is gone (killed, crashed: `close` never ran).
    The owner's pid is in the name; a directory whose pid lives (or is not ours to probe) stays."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if not name.startswith(_DIR_PREFIX):
            continue
        pid = name[len(_DIR_PREFIX):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except OSError:  # alive, under another user
            pass


def _header_or_none(frames: list[memoryview]) -> TransferHeader | None:
    try:
        return decode_header(frames[0]) if frames else None
    except PageFormatError:
        return None


def _drain(sock: zmq.Socket) -> int:
    """Read and drop the rest of a multipart message; returns how many frames that was."""
    n = 0
    while sock.getsockopt(zmq.RCVMORE):
        sock.recv(copy=False)
        n += 1
    return n
