"""A request waiting until it is placed: the scheduler's admission loop, between the door and the carry-out.

It tries to place the request on a worker with KV room for it (placement.py), under its tenant's
share (tenant_shares.py), and otherwise waits for room to free up (room_waiters.py), until its wait
budget is spent. Waiting requests take freed room by priority class, then by arrival: a request does not
place while one of a more urgent class waits for room (a flex newcomer waits behind waiting default ones,
a priority one may place at once); one that waits for its tenant's share holds no one back, so a class
never takes a tenant past its share nor lets it stand in front of other tenants. Refusals that need no wait come first: a request larger than any worker's KV or its
tenant's share, and one whose first token cannot come within the TTFT limit however long it waits.
Carrying out a placement (reserve, commit, send) stays the scheduler's; a placement that no longer
holds after its awaits comes back as None and the loop places again.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from actors.protocol.messages import Admitted, GenerateRequest, Rejected
from cluster.control.scheduler.placement import Placement, Placer
from cluster.control.scheduler.registry import WorkerRegistry
from cluster.control.scheduler.room_waiters import RoomWaiters
from cluster.control.scheduler.scheduler_state import SchedulerSettings
from cluster.control.scheduler.tenant_shares import TenantShares
from cluster.control.scheduler.ttft_guard import TtftGuard

CarryOut = Callable[[GenerateRequest, Placement, int], Awaitable["Admitted | None"]]


class UntilPlaced:
    def __init__(self, settings: SchedulerSettings, guard: TtftGuard, registry: WorkerRegistry, placer: Placer,
                 shares: TenantShares, waiters: RoomWaiters, hasher, carry_out: CarryOut):
        self.s, self._guard = settings, guard
        self._registry, self._placer, self._shares, self._waiters = registry, placer, shares, waiters
        self._hasher, self._carry_out = hasher, carry_out

    def wait_budget_s(self) -> float:
        """The longest a new request may wait for admission: waiting for KV room past the TTFT target is
        pointless too, the request would miss it."""
        return min(self.s.queue_timeout_s, self._guard.limit_s or self.s.queue_timeout_s)

    async def admit(self, request: GenerateRequest, patient: bool) -> Admitted | Rejected:
        """Placed and carried out, or refused: at once (too big for any worker or its tenant's share, no
        hope of a first token in time) or when its wait budget (or a patient request's own deadline) is spent."""
        arrived = time.monotonic()
        wait_s = self.wait_budget_s()
        if patient and request.deadline is not None:
            wait_s = max(wait_s, request.deadline - time.time())
        deadline = arrived + wait_s
        blocks_needed = self._placer.blocks_needed(request)
        hashes = self._hasher(request.prompt_token_ids, request.cache_salt)
        pool = self._placer.pool
        waiting = False  # counted among the requests of its class that wait for room (room_waiters.py)
        try:
            while True:
                workers, biggest = self._registry.pool_size(pool), self._registry.largest(pool)
                if workers and blocks_needed > biggest:
                    return Rejected(f"the request needs {blocks_needed} KV blocks (prompt + max_tokens x n); the "
                                    f"largest {pool} worker has {biggest}: lower max_tokens or n", None)
                too_big = self._shares.too_big(request, blocks_needed, pool)
                if too_big is not None:
                    return too_big
                fits = workers and self._shares.fits(request, blocks_needed, pool)
                if fits:
                    placed = None
                    if not self._waiters.more_urgent_waiting(request.priority):
                        placed = self._placer.place(request, hashes, blocks_needed, arrived)
                    if isinstance(placed, Rejected):
                        return placed
                    if placed is not None:
                        answer = await self._carry_out(request, placed, blocks_needed)
                        if answer is not None:
                            return answer
                    elif not patient and (late := self._placer.hopeless(arrived, len(request.prompt_token_ids))) is not None:
                        return late
                if time.monotonic() >= deadline:
                    if not self._registry.pool_size(pool):
                        return Rejected(f"no {pool} worker is ready", 5.0, unavailable=True)
                    if not self._shares.fits(request, blocks_needed, pool):
                        return self._shares.over_share(request, blocks_needed, pool, self._placer.retry_after_s())
                    return Rejected("no worker has room for the request's KV", self._placer.retry_after_s())
                if bool(fits) != waiting:  # waits for room now, or for its tenant's share (or for a worker)
                    (self._waiters.enter if fits else self._waiters.leave)(request.priority)
                    waiting = bool(fits)
                await self._waiters.wait(arrived, deadline - time.monotonic(), request.priority)
        finally:
            if waiting:
                self._waiters.leave(request.priority)
