"""The scheduler's request table: every request in flight, as its current attempt, and the KV each one
has committed on its decode worker.

One owner: admission reads `committed` to know a worker's room; every terminal path (finish report,
failure, abort, worker loss, a superseded attempt) ends in `reclaim`, which is idempotent and ignores a
report about any attempt but the current one. The same commitments summed by tenant (the request's cache
salt) bound what one tenant may hold.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

from actors.protocol.ids import AttemptId
from cluster.control.scheduler_state import Tracked

_ABORTS_KEPT_S = 600.0  # an abort for a request not tracked (yet): long enough for a restart to settle
_ABORTS_KEPT = 100_000


class RequestTable:
    def __init__(self) -> None:
        self.on_change: Callable[[str], None] = lambda worker_id: None  # a worker's committed KV changed
        self._requests: dict[str, Tracked] = {}
        self._committed: dict[str, int] = {}  # worker id -> KV blocks promised to requests in flight
        self._by_tenant: dict[str | None, int] = {}  # cache salt -> the same blocks, summed by tenant
        self._early_aborts: OrderedDict[str, float] = OrderedDict()  # request id -> when its abort came
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
        return [t for t in self._requests.values() if t.sent_at is not None and t.sent_at < older_than]

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

    def remember_abort(self, request_id: str) -> None:
        """An abort for a request not tracked here: after a scheduler restart it may come before the
        worker that still runs the request registers it again, which must then stop it, not adopt it."""
        now = time.monotonic()
        self._early_aborts[request_id] = now
        self._early_aborts.move_to_end(request_id)
        while self._early_aborts and (len(self._early_aborts) > _ABORTS_KEPT
                                      or next(iter(self._early_aborts.values())) < now - _ABORTS_KEPT_S):
            self._early_aborts.popitem(last=False)

    def was_aborted(self, request_id: str) -> bool:
        """Its client gave up before this table knew it; counted as cancelled (once) when it shows up."""
        if self._early_aborts.pop(request_id, None) is None:
            return False
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
    return tracked.awaiting_pages and tracked.prefill is None
