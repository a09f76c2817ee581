"""KV pages through shared memory when the sender and the receiver share a host and a user.

The zmq transport (`zmq_transport`) uses this on ipc endpoints: the sender gathers the pages ONCE, straight
from its cache into a span of a shared-memory segment (`shm_segment`), and the socket carries only a note
(the segment, a sequence number, the span) followed by the usual header. The receiver writes the pages
from the span into its blocks, exactly as it would from page frames, then says it is through with the
span. Across hosts (tcp) nothing changes.

When: a receiver that offers the path puts an identity file (`advertise`) beside its ipc socket, in its
private (0700) socket directory; a sender uses the path only if it can read that file, the file is its
own user's, and it names the same kernel boot, the same /dev/shm mount and the same user as its own
(`offers_shm`). Reading a file in a 0700 directory already proves the user; the rest rules out a socket
directory shared with a container whose /dev/shm is not ours. Otherwise the pages go as frames.

Ownership: a sender owns one lane (a segment) per receiver endpoint, and every span of it until the
receiver's DONE word reaches the note's sequence number; it writes a span only when no note in flight
covers it. The receiver takes notes of a lane in order (one sender, one socket: zmq keeps their order),
reads the span, and sets DONE to the note's number whatever the transfer's outcome (written, refused).
A sender waits for room at most until its send's deadline, then fails the send (TransferError) and drops
the lane: a receiver that died mid-copy never blocks it for longer. A sender also drops the lanes of
receivers it sees dead (the identity file names the receiver's process; `drop_dead`, at most once a
second, before each send): a decode worker killed and restarted gets a new endpoint, so no send to the old
one ever fails, and its lane (unlinked, only mapped) stayed in the sender for good.

Cleanup: the receiver removes a lane's name when it first maps it, so from then on the memory lives only
in the two mappings and goes with the processes (SIGKILL included). A name no receiver opened is removed
by its sender's `drop`/`close`, or, if the sender was killed first, by `sweep_stale` (every receiver runs
it at start and every few seconds). A receiver unmaps a lane once its sender has closed it (or is dead)
and every note sent on it was served, or after a grace period.

Trust: notes are taken only on an ipc socket (reachable by this user only); a note that names anything but
a private segment of this user, or a span outside it, is refused and counted like any other garbage.
Segments are 0600 and named with 128 random bits. A process of the same user can do anything to these
segments (as to the processes themselves): that is the boundary, as for the ipc socket directory.

Limits: workers of one host that talk tcp (a multi-node config) do not use this path. A receiver that
cannot see its senders' processes (another pid namespace sharing /dev/shm) unmaps their lanes only when
they close them, or when it needs room for newer lanes (least recently used first).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import msgpack
import torch

from kv_transfer.base import KVCaches
from kv_transfer.page_copy import gather_transfer_into
from kv_transfer.page_format import PageFormatError, TransferError, TransferHeader
from kv_transfer.shm_segment import (
    CLOSED, CONTROL_BYTES, DONE, SENT, STATE, Segment, creator_alive, host_identity, process_alive, process_identity, sweep_stale,
)

logger = logging.getLogger(__name__)

NOTE_MAGIC = b"\x00tandem-shm"  # a header frame (a msgpack map) never starts with a zero byte
_NOTE_VERSION = 1
_MAX_NOTE_BYTES = 512
IDENTITY_FILE = "shm-host"
LANE_BYTES = 256 << 20  # default room of one lane; a larger transfer gets a lane of its own size
_SPAN_ALIGN = 4096
_MAX_IN_FLIGHT = 2  # spans of a lane in flight at once: the same two stay warm in the CPU caches
_SWEEP_S = 1.0  # how often a receiver looks for lanes to unmap
_STALE_SWEEP_S = 10.0  # ... and for names of dead senders in /dev/shm
_GRACE_S = 30.0  # a closed (or orphaned) lane whose notes never all arrived is unmapped after this idle time
_MAX_LANES = 64  # lanes a receiver keeps mapped; the least recently used goes first
_PEER_CHECK_S = 1.0  # how often a sender looks for lanes whose receiver is dead


@dataclass(frozen=True)
class ShmNote:
    """Where a transfer's pages are: `pages` payloads of `page_bytes` each, back to back from `offset` of
    the data area of segment `lane`, in wire order (each layer's K pages, then its V pages)."""

    lane: str
    seq: int
    offset: int
    page_bytes: int
    pages: int


def encode_note(note: ShmNote) -> bytes:
    return NOTE_MAGIC + msgpack.packb([_NOTE_VERSION, note.lane, note.seq, note.offset, note.page_bytes, note.pages])


def is_note(frame: memoryview | bytes) -> bool:
    return bytes(frame[:len(NOTE_MAGIC)]) == NOTE_MAGIC


def decode_note(frame: memoryview | bytes) -> ShmNote:
    """Raises PageFormatError for anything that is not a note this build writes."""
    if len(frame) > _MAX_NOTE_BYTES or not is_note(frame):
        raise PageFormatError(f"malformed shared-memory note ({len(frame)} bytes)")
    try:
        msg = msgpack.unpackb(frame[len(NOTE_MAGIC):], raw=False)
    except Exception as e:  # msgpack raises several unrelated types for bad bytes
        raise PageFormatError(f"malformed shared-memory note: {type(e).__name__}") from None
    if not isinstance(msg, list) or len(msg) != 6 or msg[0] != _NOTE_VERSION or not isinstance(msg[1], str) \
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in msg[2:]) \
            or min(msg[2], msg[4], msg[5]) < 1:
        raise PageFormatError(f"malformed shared-memory note: {str(msg)[:200]}")
    return ShmNote(*msg[1:])


def advertise(socket_dir: str) -> bool:
    """Offer the shared-memory path to senders of the ipc socket in `socket_dir` (a private directory of
    this receiver); False where this host has no /dev/shm."""
    identity = host_identity()
    if identity is None:
        return False
    sweep_stale()
    fd = os.open(os.path.join(socket_dir, IDENTITY_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(identity + "\nprocess " + " ".join(map(str, process_identity())))
    return True


@dataclass(frozen=True)
class Receiver:
    """The process behind an endpoint that offers shared memory: (pid namespace, pid, start time)."""

    namespace: int
    pid: int
    start: int

    def alive(self) -> bool | None:
        return process_alive(self.namespace, self.pid, self.start)


def offers_shm(endpoint: str) -> Receiver | None:
    """The receiver at `endpoint`, if it takes notes whose segments this process can make (see above)."""
    if not endpoint.startswith("ipc://"):
        return None
    try:
        with open(os.path.join(os.path.dirname(endpoint.removeprefix("ipc://")), IDENTITY_FILE)) as f:
            if os.fstat(f.fileno()).st_uid != os.geteuid():
                return None
            theirs = f.read(512).split("\n")
    except OSError:
        return None
    mine = host_identity()
    if mine is None or len(theirs) != 2 or theirs[0] != mine:
        return None
    words = theirs[1].split()
    if len(words) != 4 or words[0] != "process" or not all(w.isdigit() for w in words[1:]):
        return None
    return Receiver(*map(int, words[1:]))


class _Lane:
    """The sender's end of one segment: which spans are in flight (first fit among them) and their notes."""

    def __init__(self, seg: Segment):
        self.seg = seg
        self._seq = 0
        self._full = False  # /dev/shm had no room for a span: said once
        self._in_flight: list[tuple[int, int, int]] = []  # (start, end, seq), by start

    def reserve(self, nbytes: int, deadline: float, what: str) -> int | None:
        """Where a span of `nbytes` starts once one is free, committed; None if /dev/shm is full. Waits
        for the receiver at most until `deadline`, then raises TransferError."""
        pause = 20e-6  # short naps: a late wake-up leaves the receiver idle (no socket tells us earlier)
        while (start := self._fit(nbytes)) is None:
            if time.monotonic() >= deadline:
                raise TransferError(f"{what}: the receiver has not released shared memory in time")
            time.sleep(pause)
            pause = min(2 * pause, 200e-6)
        try:
            self.seg.commit(start + nbytes)
        except OSError as e:
            if not self._full:
                logger.warning("%s: no room for %d bytes in /dev/shm (%s); sending frames", what, nbytes, e)
            self._full = True
            return None
        return start

    def _fit(self, nbytes: int) -> int | None:
        done = self.seg.word(DONE)
        self._in_flight = [s for s in self._in_flight if s[2] > done]
        if len(self._in_flight) >= _MAX_IN_FLIGHT:
            return None
        pos = 0
        for start, end, _ in self._in_flight:
            if start - pos >= nbytes:
                return pos
            pos = end
        return pos if self.seg.capacity - pos >= nbytes else None

    def publish(self, start: int, page_bytes: int, pages: int) -> ShmNote:
        self._seq += 1
        end = start + -(-page_bytes * pages // _SPAN_ALIGN) * _SPAN_ALIGN
        self._in_flight = sorted(self._in_flight + [(start, end, self._seq)])
        self.seg.set(SENT, self._seq)
        return ShmNote(self.seg.name, self._seq, start, page_bytes, pages)

    def drained(self) -> bool:
        return self.seg.word(DONE) >= self._seq

    def check_integrity(self) -> None:
        spans = self._in_flight
        bad = [s for s in spans if not 0 <= s[0] < s[1] <= self.seg.capacity or not 0 < s[2] <= self._seq]
        overlaps = sum(a[1] > b[0] for a, b in zip(spans, spans[1:]))
        if self.seg.data is None or bad or overlaps or len(spans) > _MAX_IN_FLIGHT or spans != sorted(spans):
            raise RuntimeError(f"lane {self.seg.name}: {len(spans)} spans in flight (at most {_MAX_IN_FLIGHT}), "
                               f"{len(bad)} outside [0, {self.seg.capacity}) or past seq {self._seq}, {overlaps} "
                               f"overlapping, mapped {self.seg.data is not None}")

    def wait_drained(self, deadline: float) -> bool:
        while not self.drained() and time.monotonic() < deadline:
            time.sleep(1e-3)
        return self.drained()


class ShmLanes:
    """A sender's lanes, one per receiver endpoint that offers the path. Used from the sender's thread."""

    def __init__(self, lane_bytes: int = LANE_BYTES):
        self._lane_bytes = -(-lane_bytes // _SPAN_ALIGN) * _SPAN_ALIGN
        self._lanes: dict[str, _Lane] = {}
        self._offers: dict[str, Receiver | None] = {}  # None: that endpoint gets frames
        self._checked = time.monotonic()

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(self._lanes)

    @property
    def mapped_bytes(self) -> int:
        """Shared memory this sender keeps mapped (its lanes' segments, control pages included)."""
        return sum(CONTROL_BYTES + lane.seg.capacity for lane in self._lanes.values())

    def put(self, endpoint: str, header: TransferHeader, kv_caches: KVCaches, src: torch.Tensor,
            heads: tuple[int, int] | None, deadline: float) -> ShmNote | None:
        """Gather the transfer's pages into a span of `endpoint`'s lane; the note to send, or None if the
        pages must go as frames (no shared memory with that receiver, or none left)."""
        if time.monotonic() - self._checked >= _PEER_CHECK_S:
            self.drop_dead()
        if endpoint not in self._offers:
            self._offers[endpoint] = offers_shm(endpoint)
        if self._offers[endpoint] is None:
            return None
        what = f"transfer {header.transfer_id} to {endpoint}"
        page_bytes = header.num_blocks * header.spec.page_nbytes
        nbytes = 2 * header.spec.num_layers * page_bytes
        lane = self._lane(endpoint, nbytes, deadline, what)
        start = None if lane is None else lane.reserve(nbytes, deadline, what)
        if start is None:
            return None
        gather_transfer_into(kv_caches, src, lane.seg.data[start:start + nbytes], heads)
        return lane.publish(start, page_bytes, 2 * header.spec.num_layers)

    def _lane(self, endpoint: str, nbytes: int, deadline: float, what: str) -> _Lane | None:
        lane = self._lanes.get(endpoint)
        if lane is not None and lane.seg.capacity < nbytes:  # too small: replace it once it is drained
            if not lane.wait_drained(deadline):
                raise TransferError(f"{what}: the receiver has not released shared memory in time")
            self.drop(endpoint, keep_offer=True)
            lane = None
        if lane is None:
            try:
                lane = _Lane(Segment.create(max(self._lane_bytes, -(-nbytes // _SPAN_ALIGN) * _SPAN_ALIGN)))
            except OSError as e:
                logger.warning("%s: cannot make a shared-memory segment (%s); frames to it from now on", what, e)
                self._offers[endpoint] = None
                return None
            self._lanes[endpoint] = lane
        return lane

    def drop(self, endpoint: str, keep_offer: bool = False) -> None:
        """Forget `endpoint`'s lane at once (its send failed); the next send starts afresh."""
        lane = self._lanes.pop(endpoint, None)
        if lane is not None:
            lane.seg.close()
        if not keep_offer:
            self._offers.pop(endpoint, None)

    def drop_dead(self) -> list[str]:
        """Drop the lanes (and forget the offers) of receivers whose process is gone; returns their
        endpoints. A receiver this process cannot judge (another pid namespace) keeps its lane."""
        self._checked = time.monotonic()
        dead = [e for e, peer in self._offers.items() if peer is not None and peer.alive() is False]
        for endpoint in dead:
            self.drop(endpoint)
        return dead

    def check_integrity(self) -> None:
        """Every lane goes to a receiver that offered shared memory, and its spans in flight are sane."""
        offerless = [e for e in self._lanes if self._offers.get(e) is None]
        if offerless:
            raise RuntimeError(f"{len(self._lanes)} shared-memory lanes, {len(offerless)} to endpoints with no "
                               f"offer: {offerless}")
        for lane in self._lanes.values():
            lane.check_integrity()

    def close(self, linger_s: float) -> None:
        """Give notes still in flight up to `linger_s` in all to be served, then close every lane."""
        deadline = time.monotonic() + linger_s
        for endpoint, lane in list(self._lanes.items()):
            lane.wait_drained(deadline)
            self.drop(endpoint)


@dataclass
class _Mapped:
    seg: Segment
    last: int  # the last note served
    used: float


class ShmLaneTable:
    """A receiver's mapped lanes. Used from the receiving thread only (which closes it when it ends)."""

    def __init__(self, max_pages: int):
        self._max_pages = max_pages  # page payloads of the largest transfer (2 x layers)
        self._lanes: dict[str, _Mapped] = {}
        self._swept = self._stale_swept = time.monotonic()

    def __len__(self) -> int:
        return len(self._lanes)

    def payloads(self, note: ShmNote) -> list[memoryview]:
        """Views of the note's page payloads; raises PageFormatError if the note is not one to serve.
        A caller that got them calls `release(note)` once it is through with them."""
        lane = self._lanes.get(note.lane) or self._open(note.lane)
        if note.seq <= lane.last:
            raise PageFormatError(f"shared-memory note {note.seq} of {note.lane}: already served ({lane.last})")
        end = note.offset + note.page_bytes * note.pages
        if note.offset % _SPAN_ALIGN or end > lane.seg.capacity:
            raise PageFormatError(f"shared-memory note {note.seq}: span [{note.offset}, {end}) is not in the "
                                  f"{lane.seg.capacity}-byte segment {note.lane}")
        lane.used = time.monotonic()
        # A real span from here on (released whatever happens). More pages than any transfer has: one view
        # too many is enough for the size check to refuse it.
        return [lane.seg.span(note.offset + i * note.page_bytes, note.page_bytes)
                for i in range(min(note.pages, self._max_pages + 1))]

    def release(self, note: ShmNote) -> None:
        lane = self._lanes.get(note.lane)
        if lane is not None and note.seq > lane.last:
            lane.last = note.seq
            lane.seg.set(DONE, note.seq)

    def _open(self, name: str) -> _Mapped:
        seg = Segment.open(name)  # first: a note naming nothing valid evicts nobody
        if len(self._lanes) >= _MAX_LANES:
            oldest = min(self._lanes, key=lambda n: self._lanes[n].used)
            self._lanes.pop(oldest).seg.close()
        self._lanes[name] = lane = _Mapped(seg, seg.word(DONE), time.monotonic())
        return lane

    def sweep(self) -> None:
        """Unmap lanes whose sender is through with them; now and then remove dead senders' names."""
        now = time.monotonic()
        if now - self._swept < _SWEEP_S:
            return
        self._swept = now
        try:
            for name, lane in list(self._lanes.items()):
                ended = lane.seg.word(STATE) == CLOSED or creator_alive(name) is False
                if ended and (lane.last >= lane.seg.word(SENT) or now - lane.used > _GRACE_S):
                    self._lanes.pop(name).seg.close()
            if now - self._stale_swept >= _STALE_SWEEP_S:
                self._stale_swept = now
                sweep_stale()
        except Exception:  # housekeeping: never the end of the receiving thread
            logger.exception("sweeping shared-memory lanes failed; trying again later")

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.seg.close()
        self._lanes.clear()
