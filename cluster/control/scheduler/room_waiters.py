"""Requests waiting for KV room, woken most urgent first when room may have freed.

Polling (every waiting request placing itself again every few milliseconds) costs the scheduler
waiters x polls per second exactly when it is overloaded, and the work it burns delays the finish
reports that would free the room: throughput fell as the offered load rose. Here a request that finds
no room waits until a commitment ends (a reclaim) or a worker joins, and only the first few wake per
event; one fallback poll, which wakes the first few every `_FALLBACK_S`, covers whatever else changes
(a worker's size in a report). A poll per waiter cost thousands of futile placements per second at
overload (measured: a quarter of the scheduler's CPU).

Order: by the request's priority class (`GenerateRequest.priority`, lower first: the HTTP `service_tier`
priority -1, default 0, flex 1), then by arrival. The classes of the requests waiting for room are
counted here too (`enter`/`leave`, by `UntilPlaced`), so that a newcomer does not take freed room ahead
of a more urgent request already waiting (`more_urgent_waiting`).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

_WAKE_PER_EVENT = 2  # a reclaim frees about one request's room
_FALLBACK_S = 0.05
_WAKE_PER_POLL = 8


class RoomWaiters:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, asyncio.Future]] = []
        self._order = itertools.count()
        self._live = 0  # waits not yet woken or timed out
        self._poll: asyncio.TimerHandle | None = None
        self._classes: dict[int, int] = {}  # priority class -> requests in it waiting for room

    def enter(self, priority: int) -> None:
        """A request of class `priority` waits for room (until `leave`): newcomers of a less urgent class
        wait behind it."""
        self._classes[priority] = self._classes.get(priority, 0) + 1

    def leave(self, priority: int) -> None:
        self._classes[priority] -= 1
        if not self._classes[priority]:
            del self._classes[priority]

    def more_urgent_waiting(self, priority: int) -> bool:
        """A request of a more urgent class (lower `priority`) waits for room: freed room is its first."""
        return any(p < priority for p in self._classes)

    async def wait(self, arrived: float, timeout_s: float, priority: int = 0) -> None:
        """Until woken (by an event or the fallback poll) or `timeout_s`; (`priority`, `arrived`) orders the
        waiters (most urgent class first, then oldest first)."""
        future = asyncio.get_running_loop().create_future()
        if len(self._heap) > 64 and len(self._heap) > 2 * self._live:  # timed-out waits pile up when nothing frees
            self._heap = [entry for entry in self._heap if not entry[3].done()]
            heapq.heapify(self._heap)
        heapq.heappush(self._heap, (priority, arrived, next(self._order), future))
        self._live += 1
        future.add_done_callback(self._ended)
        if self._poll is None:
            self._poll = asyncio.get_running_loop().call_later(_FALLBACK_S, self._polled)
        try:
            await asyncio.wait_for(future, max(0.0, timeout_s))
        except asyncio.TimeoutError:
            pass

    def _polled(self) -> None:
        self._poll = None
        self.freed(_WAKE_PER_POLL)
        if self._live:
            self._poll = asyncio.get_running_loop().call_later(_FALLBACK_S, self._polled)

    def freed(self, count: int = _WAKE_PER_EVENT) -> None:
        """Room may have freed: wake the first `count` waiters (entries of timed-out waits are dropped)."""
        while self._heap and count > 0:
            future = heapq.heappop(self._heap)[3]
            if not future.done():
                future.set_result(None)
                count -= 1

    def joined(self) -> None:
        """A worker joined: every waiter may fit now."""
        self.freed(len(self._heap))

    def _ended(self, _future: asyncio.Future) -> None:
        self._live -= 1

    def check_integrity(self) -> None:
        if any(n <= 0 for n in self._classes.values()) or self._live < 0:
            raise RuntimeError(f"room waiters: classes {self._classes} count a class with none, or {self._live} "
                               "live waits")
