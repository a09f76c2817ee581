"""The scheduler's request table: every request in flight, as its current attempt, and the KV each one
has committed on its decode worker.

One owner, and the only writer of a request's record (`Tracked`): it enters with `commit` (or
`adopt_live`, from a worker that registers again), moves through its phases by named transitions
(`confirm`, `handed_off`), and every terminal path (finish report, failure, abort, worker loss, a
superseded attempt) ends in `reclaim`, which is idempotent and ignores a report about any attempt but the
current one. Admission reads `committed` to know a worker's room; the same commitments summed by tenant
(the request's cache salt) bound what one tenant may hold.
"""

from __future__ import annotations

import enum
import time
from typing import Callable

from actors.protocol.ids import AttemptId
from actors.protocol.handoff_phase import HandoffPhase
from actors.protocol.messages import LiveRequest
from cluster.control.scheduler.recent import Recent
from cluster.control.scheduler.routing import PrefillPlan
from cluster.control.scheduler.scheduler_state import Phase, Tracked

_ABORTS_KEPT_S = 600.0  # aborts and ended attempts: long enough for a restart to settle
_ABORTS_KEPT = 100_000


class Adoption(enum.Enum):
    """What the announcing worker (or the request's prefill worker) is told about an attempt it holds."""

    KEEP = "keep"
    RELEASE = "release"  # a hold of pages sent in full: the decode side announces the request itself
    ABORT = "abort"  # superseded, or its client gave up meanwhile
    RELEASE_PREFILL = "release_prefill"  # adopted by its decode worker while no scheduler heard of it


class RequestTable:
    def __init__(self) -> None:
        self.on_change: Callable[[str], None] = lambda worker_id: None  # a worker's committed KV changed
        self._requests: dict[str, Tracked] = {}
        self._committed: dict[str, int] = {}  # worker id -> KV blocks promised to requests in flight
        self._by_tenant: dict[str | None, int] = {}  # cache salt -> the same blocks, summed by tenant
        # request id -> whether it was counted (at its first announcement): aborts that came before it
        self._early_aborts: Recent[str, bool] = Recent(_ABORTS_KEPT_S, _ABORTS_KEPT)
        self._ended: Recent[AttemptId, bool] = Recent(_ABORTS_KEPT_S, _ABORTS_KEPT)  # attempts reclaimed
        self._admitting: dict[str, int] = {}  # request id -> submits of it being decided now (not tracked yet)
        self.finished = 0
        self.failed = 0
        self.cancelled = 0  # ended by their client (abort, deadline, disconnect) before the cluster finished

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def get(self, request_id: str) -> Tracked | None:
        return self._requests.get(request_id)

    def current(self, attempt: AttemptId) -> Tracked | None:
        """The tracked request if `attempt` is its current attempt, else None (a stale message)."""
        tracked = self._requests.get(attempt.request_id)
        return tracked if tracked is not None and tracked.attempt == attempt else None

    def unconfirmed(self, older_than: float) -> list[Tracked]:
        """Attempts sent to a worker before `older_than` (monotonic) that it has not confirmed yet."""
        return [t for t in self._requests.values() if t.phase is Phase.SENT and t.since < older_than]

    # ---- admission ----

    def admission_started(self, request_id: str) -> None:
        self._admitting[request_id] = self._admitting.get(request_id, 0) + 1

    def admission_ended(self, request_id: str) -> None:
        left = self._admitting.pop(request_id) - 1
        if left:
            self._admitting[request_id] = left

    def admitting(self, request_id: str) -> bool:
        """A submit of the request is being decided now (a resent one waits for it: it must run once)."""
        return request_id in self._admitting

    # ---- transitions ----

    def confirm(self, attempt: AttemptId) -> None:
        """The worker computing the attempt's prompt has it (its report named it)."""
        tracked = self.current(attempt)
        if tracked is not None and tracked.phase is Phase.SENT:
            self._enter(tracked, Phase.RUNNING)

    def handed_off(self, attempt: AttemptId) -> None:
        """Its decode worker adopted the pages: the prefill worker's copy is no longer the request's."""
        tracked = self.current(attempt)
        if tracked is None:
            return
        if tracked.prefill is not None:
            tracked.workers.discard(tracked.prefill.worker_id)
        # (prefill None: rebuilt from a reservation after a restart; its pages came after all)
        self._enter(tracked, Phase.HANDED_OFF if tracked.prefill is not None else Phase.RUNNING)

    def adopt_live(self, worker_id: str, role: str, item: LiveRequest, blocks: int) -> Adoption:
        """A worker that registers (again) holds `item`: track it from what the worker knows. Idempotent:
        a worker may announce the same request more than once."""
        attempt = item.request.attempt
        if item.phase is HandoffPhase.HELD:
            # Tracking the hold would outlive a request that finished while no scheduler could hear of it.
            return Adoption.RELEASE
        tracked = self._requests.get(attempt.request_id)
        if (tracked is not None and tracked.attempt != attempt) or self._ended.get(attempt) \
                or self.was_aborted(attempt.request_id):
            return Adoption.ABORT  # (ended: announced by a registration that raced its end)
        if tracked is None:
            decode_id = item.request.dest.decode_worker if role == "prefill" else worker_id
            tracked = Tracked(item.request.request, attempt, set(), decode_id, blocks, phase=Phase.RUNNING)
            self.commit(tracked)
        tracked.workers.add(worker_id)
        if role == "prefill":
            tracked.prefill = PrefillPlan(worker_id, False, 0, 0.0)
        if role == "decode" and item.phase is HandoffPhase.RESERVED:
            self._enter(tracked, Phase.AWAITING_PAGES)
        elif role != "prefill" and tracked.prefill is not None and tracked.prefill.worker_id != worker_id:
            self._enter(tracked, Phase.HANDED_OFF)  # running on its decode worker: the pages were adopted
        elif tracked.phase is not Phase.HANDED_OFF:
            self._enter(tracked, Phase.RUNNING)
        if tracked.phase is Phase.HANDED_OFF and tracked.prefill is not None and tracked.prefill.worker_id in tracked.workers:
            tracked.workers.discard(tracked.prefill.worker_id)
            return Adoption.RELEASE_PREFILL
        return Adoption.KEEP

    def _enter(self, tracked: Tracked, phase: Phase) -> None:
        if tracked.phase is not phase:
            tracked.phase, tracked.since = phase, time.monotonic()

    def commit(self, tracked: Tracked) -> Tracked | None:
        """Track an attempt and commit its KV. Returns the older attempt it replaces, already reclaimed
        (the caller aborts it on its workers): its KV is released, never overwritten."""
        old = self._requests.get(tracked.request_id)
        if old is not None:
            self.reclaim(old.attempt, failed=True)
        self._requests[tracked.request_id] = tracked
        self._committed[tracked.decode_id] = self._committed.get(tracked.decode_id, 0) + tracked.blocks
        tenant = tracked.request.cache_salt
        self._by_tenant[tenant] = self._by_tenant.get(tenant, 0) + tracked.blocks
        self.on_change(tracked.decode_id)
        return old

    def reclaim(self, attempt: AttemptId | str, failed: bool, cancelled: bool = False) -> Tracked | None:
        """End a request: by its attempt (only if it is the current one) or by request id (any attempt).
        Returns what was tracked, or None if nothing was (a second call is a no-op)."""
        tracked = self.current(attempt) if isinstance(attempt, AttemptId) else self._requests.get(attempt)
        if tracked is None:
            return None
        del self._requests[tracked.request_id]
        self._ended.put(tracked.attempt, True)
        self._committed[tracked.decode_id] -= tracked.blocks
        if not self._committed[tracked.decode_id]:
            del self._committed[tracked.decode_id]
        tenant = tracked.request.cache_salt
        self._by_tenant[tenant] -= tracked.blocks
        if not self._by_tenant[tenant]:
            del self._by_tenant[tenant]
        self.on_change(tracked.decode_id)
        if failed:
            self.failed += 1
        elif cancelled:
            self.cancelled += 1
        else:
            self.finished += 1
        return tracked

    def ended(self, attempt: AttemptId) -> None:
        """A worker reports the attempt ended there. After a scheduler restart that report may come before the
        worker's registration, which lists the attempt live (its list was taken before the end): adopted
        then, it would be tracked forever. Remembered, the announcement is refused (`adopt_live`)."""
        if self.current(attempt) is None:
            self._ended.put(attempt, True)

    def remember_abort(self, request_id: str) -> None:
        """An abort for a request not tracked here: after a scheduler restart it may come before the
        worker that still runs the request registers it again, which must then stop it, not adopt it."""
        self._early_aborts.put(request_id, self._early_aborts.get(request_id) or False)

    def was_aborted(self, request_id: str) -> bool:
        """Its client gave up before this table knew it; counted as cancelled (once) when it shows up. Kept
        after that: the request may be announced again (by its other worker, or by a second registration
        that listed it before the abort stopped it), and every announcement must be aborted, none adopted."""
        counted = self._early_aborts.get(request_id)
        if counted is None:
            return False
        if not counted:
            self._early_aborts.put(request_id, True)
            self.cancelled += 1
        return True

    def orphaned(self) -> list[Tracked]:
        """Requests rebuilt from a decode worker's reservation that no prefill worker claimed (adoption.py)."""
        return [t for t in self._requests.values() if _unclaimed(t)]

    def claimed(self, request_id: str) -> bool:
        """Tracked, and not only as a reservation rebuilt after a restart that no prefill worker has claimed
        (yet): such a request is neither known nor lost until the scheduler's incarnation settles."""
        tracked = self._requests.get(request_id)
        return tracked is not None and not _unclaimed(tracked)

    def touching(self, worker_id: str) -> list[Tracked]:
        return [t for t in self._requests.values() if worker_id in t.workers or t.decode_id == worker_id]

    def committed(self, worker_id: str) -> int:
        return self._committed.get(worker_id, 0)

    def committed_blocks(self) -> dict[str, int]:
        return dict(self._committed)

    def tenant_committed(self, cache_salt: str | None) -> int:
        return self._by_tenant.get(cache_salt, 0)

    def tenant_blocks(self) -> dict[str, int]:
        """KV blocks committed per named tenant (anonymous requests are left out)."""
        return {t: n for t, n in self._by_tenant.items() if t is not None}

    def check_integrity(self, known_workers: set[str]) -> None:
        expected: dict[str, int] = {}
        by_tenant: dict[str | None, int] = {}
        for t in self._requests.values():
            expected[t.decode_id] = expected.get(t.decode_id, 0) + t.blocks
            by_tenant[t.request.cache_salt] = by_tenant.get(t.request.cache_salt, 0) + t.blocks
        if self._committed != {wid: n for wid, n in expected.items() if n}:
            raise RuntimeError(f"committed KV {self._committed} does not match the requests in flight {expected}")
        if self._by_tenant != {t: n for t, n in by_tenant.items() if n}:
            raise RuntimeError(f"KV by tenant {self._by_tenant} does not match the requests in flight {by_tenant}")
        for t in self._requests.values():
            unknown = t.workers - known_workers
            if unknown:
                raise RuntimeError(f"request {t.request_id} tracked on unknown workers {sorted(unknown)}")


def _unclaimed(tracked: Tracked) -> bool:
    return tracked.phase is Phase.AWAITING_PAGES and tracked.prefill is None
