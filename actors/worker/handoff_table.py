"""The worker's handoff table: the one owner of lease deadlines and page writes in flight.

A decode worker *reserves* blocks for an attempt's incoming pages under a lease; a prefill worker
*holds* the blocks of pages it sent until the scheduler releases them. The attempt itself, its blocks
and its phase (RESERVED, HELD: actors/protocol/handoff_phase.py) are the engine's one record of it (actors/engine/requests.py), under
the attempt's one key; the table keeps only what is its own: when each lease ends, the transfer name
senders use, and which pieces are being written. Every way a lease ends goes through this table (adopt,
release, abort, expiry, transfer failure, worker failure), and it is the only caller of the engine's
`release`, so no path can free blocks a write is still filling.

Pieces: a reservation's pages may come as several transfers (*pieces*): in a tensor-parallel worker
each rank's cache holds some of the KV heads, and each rank receives its heads, possibly from several
prefill ranks. The table (on rank 0) admits every piece of every rank and adopts the attempt once each
rank has every one of its heads.

Threads: the receiver threads call `admit` before they write a piece (under the table's lock; the other
ranks' receivers through rank 0's piece desk); everything else runs on the engine thread. A reservation
with a piece being written is never freed under it: an abort, an expiry or a failed piece in the middle
of a write only marks it, and its blocks are freed when the last write has ended (`landed`), so late
pages can never reach blocks given to another request. Pages for a lease that is gone are refused
before a byte is written, and counted.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

from typing import Any

from actors.engine.engine import Engine
from actors.protocol.handoff_phase import HandoffPhase
from actors.protocol.ids import AttemptId
from actors.protocol.messages import KvReservation
from actors.protocol.tp_messages import KvPiece
from kv_transfer.page_format import PageFormatError

Piece = tuple[int, int, int]  # (rank, first head, number of heads)


class LeaseRefused(PageFormatError):
    """A piece for a lease that has ended, or one already written: dropped and counted, it fails nothing."""


@dataclass
class Lease:
    kind: HandoffPhase  # RESERVED (decode: pages not adopted yet) or HELD (prefill: until released)
    attempt: AttemptId  # the engine's key of the attempt too
    deadline: float  # time.monotonic()
    lease_id: str | None = None  # reservations: the transfer name senders use
    writing: set[Piece] = field(default_factory=set)  # pieces being written right now
    landed: set[tuple[int, int]] = field(default_factory=set)  # (rank, head) written
    cancelled: bool = False  # ended during a write: freed once the writes are over
    note: bytes = b""  # the sender's handoff note, from the pieces that landed
    context: Any = None  # once handed back to the worker (ended, or to adopt): the engine record's tag


class HandoffTable:
    def __init__(self, engine: Engine, lease_s: float):
        self._engine = engine
        _, by_rank = engine.kv_heads
        self._needed = frozenset((rank, h) for rank, (a, b) in enumerate(by_rank) for h in range(a, b))
        self._lease_s = lease_s
        self._lock = threading.Lock()
        self._leases: dict[AttemptId, Lease] = {}
        self._by_lease_id: dict[str, Lease] = {}
        self.late_pages_dropped = 0  # transfers refused because their lease had ended
        self.expired = 0
        self.overrun_s = 0.0  # the latest any lease was released after its deadline

    # ---- decode: reservations ----

    def reserve(self, attempt: AttemptId, num_tokens: int, context: Any) -> KvReservation | None:
        """Set blocks aside in the engine for the attempt's prompt (`context`: the worker's, kept in the
        engine's record); None when they do not fit now."""
        if attempt in self._leases:
            raise ValueError(f"attempt {attempt} already has a lease here")
        blocks = self._engine.reserve(attempt, num_tokens, context)
        if blocks is None:
            return None
        lease = Lease(HandoffPhase.RESERVED, attempt, time.monotonic() + self._lease_s, uuid.uuid4().hex)
        with self._lock:
            self._leases[attempt] = lease
            self._by_lease_id[lease.lease_id] = lease
        return KvReservation(lease.lease_id, tuple(blocks))

    def admit(self, piece: KvPiece) -> None:
        """A receiver thread, before any byte of a piece is written: only into a live reservation's own
        blocks, only heads of that rank, each once."""
        key = (piece.rank, piece.first_head, piece.num_heads)
        heads = {(piece.rank, h) for h in range(piece.first_head, piece.first_head + piece.num_heads)}
        with self._lock:
            lease = self._by_lease_id.get(piece.lease_id)
            if lease is None or lease.cancelled:
                self.late_pages_dropped += 1
                raise LeaseRefused(f"transfer {piece.lease_id}: no live reservation (lease ended)")
            # The engine's blocks of a reservation never change while its lease is here (only this table
            # frees them, after dropping the lease under this lock), so a receiver thread may read them.
            if list(piece.dest_block_ids) != self._engine.lease_blocks(lease.attempt):
                raise PageFormatError(f"transfer {piece.lease_id}: destination blocks are not the reservation's")
            if not heads <= self._needed:
                raise PageFormatError(f"transfer {piece.lease_id}: rank {piece.rank} does not hold heads "
                                      f"[{piece.first_head}, {piece.first_head + piece.num_heads})")
            if heads & (lease.landed | {(r, h) for r, a, n in lease.writing for h in range(a, a + n)}):
                raise LeaseRefused(f"transfer {piece.lease_id}: heads of rank {piece.rank} written twice")
            lease.writing.add(key)

    def landed(self, piece: KvPiece, ok: bool, note: bytes = b"", adopt: bool = True) -> Lease | None:
        """Engine thread, after an admitted piece's write ended (`ok`: every page written). Returns the
        reservation to adopt (ok, and every head of every rank has landed: the caller then ends it with
        `adopted`, or with `release` when the engine refuses the pages) or to fail (the first piece that
        failed: ended). None when there is nothing to do: more pieces are due, the lease had ended (its
        blocks are freed once no piece is being written), or `adopt` is False (a fault hook: the pages
        are ignored and the reservation waits for its lease to end)."""
        key = (piece.rank, piece.first_head, piece.num_heads)
        with self._lock:
            lease = self._by_lease_id.get(piece.lease_id)
            if lease is None or key not in lease.writing:
                return None
            lease.writing.discard(key)
            if lease.cancelled:
                self.late_pages_dropped += 1
                result = None
            elif not ok:
                self._cancel(lease)
                lease.context = self._engine.tag(lease.attempt)
                result = lease
            else:
                lease.landed |= {(piece.rank, h) for h in range(piece.first_head, piece.first_head + piece.num_heads)}
                lease.note = lease.note or note
                if lease.writing or lease.landed != self._needed or not adopt:
                    return None
                lease.context = self._engine.tag(lease.attempt)
                return lease  # to adopt: then `adopted`, or `release` if the engine refuses it
            if lease.writing:
                return result  # the other pieces' writes end first; the last one frees the blocks
            self._forget(lease)
        self._engine.release(lease.attempt)
        return result

    def refused(self, lease_id: str) -> Lease | None:
        """Engine thread: a piece naming this lease was refused before any byte was written (its pages do
        not fit the reservation: another dtype, other blocks, heads its rank does not hold). Returns the
        reservation, ended, for its request to fail with the reason; None if the lease is gone."""
        with self._lock:
            lease = self._by_lease_id.get(lease_id)
            if lease is None or lease.cancelled:
                return None
            self._cancel(lease)
            lease.context = self._engine.tag(lease.attempt)
            if lease.writing:
                return lease
            self._forget(lease)
        self._engine.release(lease.attempt)
        return lease

    def adopted(self, attempt: AttemptId) -> None:
        """The engine runs the attempt in its reserved blocks now: the lease is over, the blocks stay."""
        with self._lock:
            lease = self._leases.get(attempt)
            if lease is not None and not lease.writing:
                self._forget(lease)

    # ---- prefill: holds ----

    def hold(self, attempt: AttemptId) -> None:
        """The attempt was handed off (its pages are being sent): keep its blocks until `release` or the
        lease ends."""
        with self._lock:
            self._leases[attempt] = Lease(HandoffPhase.HELD, attempt, time.monotonic() + self._lease_s)

    # ---- every end of a lease ----

    def release(self, attempt: AttemptId) -> Lease | None:
        """Free the attempt's lease (idempotent): a hold after its ack, or anything on abort/failure."""
        with self._lock:
            lease = self._leases.get(attempt)
            if lease is None:
                return None
            lease.context = self._engine.tag(attempt)
            if lease.writing:
                self._cancel(lease)  # `landed` frees the blocks once the writes are over
                return lease
            self._forget(lease)
        self._engine.release(attempt)
        return lease

    def expire(self, now: float) -> list[Lease]:
        """Leases past their deadline, released (a reservation being written waits for the write)."""
        with self._lock:
            due = [lease for lease in self._leases.values() if lease.deadline < now and not lease.writing]
        for lease in due:
            self.release(lease.attempt)
            self.expired += 1
            self.overrun_s = max(self.overrun_s, now - lease.deadline)
        return due

    def release_all(self) -> list[Lease]:
        with self._lock:
            leases = list(self._leases.values())
        for lease in leases:
            self.release(lease.attempt)
        return leases

    # ---- introspection ----

    def oldest_reservation_s(self, now: float) -> float:
        """How long the oldest reservation still waiting for its pages has waited (0 if none)."""
        with self._lock:
            starts = [lease.deadline - self._lease_s for lease in self._leases.values()
                      if lease.kind is HandoffPhase.RESERVED and not lease.landed]
        return max((now - start for start in starts), default=0.0)

    def get(self, attempt: AttemptId) -> Lease | None:
        return self._leases.get(attempt)

    def count(self, kind: HandoffPhase) -> int:
        return sum(lease.kind is kind for lease in list(self._leases.values()))

    def writing(self) -> int:
        return sum(bool(lease.writing) for lease in list(self._by_lease_id.values()))

    def check_integrity(self) -> None:
        with self._lock:
            reserved = {lease.lease_id: lease for lease in self._leases.values() if lease.kind is HandoffPhase.RESERVED}
            cancelled = {lid: lease for lid, lease in self._by_lease_id.items() if lease.cancelled}
            if set(self._by_lease_id) != set(reserved) | set(cancelled):
                raise RuntimeError(f"handoff table: {len(self._by_lease_id)} lease ids for {len(reserved)} "
                                   f"reservations and {len(cancelled)} cancelled writes")
            for lease in cancelled.values():
                if not lease.writing:
                    raise RuntimeError(f"handoff table: cancelled lease {lease.lease_id} is not being written")
            for lease in reserved.values():
                if not lease.landed <= self._needed:
                    raise RuntimeError(f"handoff table: reservation {lease.lease_id} landed heads no rank holds")
            leases = list(self._by_lease_id.values())
            leased = {lease.attempt for lease in self._leases.values()} | {lease.attempt for lease in leases}
            for lease in self._leases.values():
                if self._engine.phase(lease.attempt) is not lease.kind:
                    raise RuntimeError(f"handoff table: a {lease.kind.value} lease of {lease.attempt}, which the "
                                       f"engine has {self._engine.phase(lease.attempt)}")
        unleased = set(self._engine.holding()) - leased
        if unleased:
            raise RuntimeError(f"handoff table: {len(unleased)} requests hold lease blocks in the engine without a "
                               f"lease (e.g. {next(iter(unleased))})")

    # ---- internals (callers hold the lock where noted) ----

    def _cancel(self, lease: Lease) -> None:  # lock held
        lease.cancelled = True
        self._leases.pop(lease.attempt, None)

    def _forget(self, lease: Lease) -> None:  # lock held
        self._leases.pop(lease.attempt, None)
        if lease.lease_id is not None:
            self._by_lease_id.pop(lease.lease_id, None)
