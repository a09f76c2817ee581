"""Requests waiting for KV room, woken oldest first when room may have freed.

Polling (every waiting request placing itself again every few milliseconds) costs the scheduler
waiters x polls per second exactly when it is overloaded, and the work it burns delays the finish
reports that would free the room: throughput fell as the offered load rose. Here a request that finds
no room waits until a commitment ends (a reclaim) or a worker joins, and only the oldest few wake per
event; one fallback poll, which wakes the oldest few every `_FALLBACK_S`, covers whatever else changes
(a worker's size in a report). A poll per waiter cost thousands of futile placements per second at
overload (measured: a quarter of the scheduler's CPU).
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
        self._heap: list[tuple[float, int, asyncio.Future]] = []
        self._order = itertools.count()
        self._live = 0  # waits not yet woken or timed out
        self._poll: asyncio.TimerHandle | None = None

    async def wait(self, arrived: float, timeout_s: float) -> None:
        """Until woken (by an event or the fallback poll) or `timeout_s`; `arrived` orders the waiters
        (oldest first)."""
        future = asyncio.get_running_loop().create_future()
        if len(self._heap) > 64 and len(self._heap) > 2 * self._live:  # timed-out waits pile up when nothing frees
            self._heap = [entry for entry in self._heap if not entry[2].done()]
            heapq.heapify(self._heap)
        heapq.heappush(self._heap, (arrived, next(self._order), future))
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
        """Room may have freed: wake the `count` oldest waiters (entries of timed-out waits are dropped)."""
        while self._heap and count > 0:
            _, _, future = heapq.heappop(self._heap)
            if not future.done():
                future.set_result(None)
                count -= 1

    def joined(self) -> None:
        """A worker joined: every waiter may fit now."""
        self.freed(len(self._heap))

    def _ended(self, _future: asyncio.Future) -> None:
        self._live -= 1
