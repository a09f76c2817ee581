"""Where one request's deltas wait for its pump (`TandemClient.pump`): an asyncio queue on the pump's
event loop, put into from the client's zmq thread.

It may be bounded (the HTTP ingress bounds it per request): a reader too slow for the bound overflows
it, what it never read is dropped, and the pump ends the request (aborted in the cluster) rather than
buffering it without bound.
"""

from __future__ import annotations

import asyncio

OVERFLOW = object()  # what the pump gets once the inbox overflowed


class Inbox:
    def __init__(self, loop: asyncio.AbstractEventLoop, maxsize: int = 0):
        """`loop`: where the pump runs; `maxsize` 0: unbounded."""
        self.loop = loop
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=maxsize)
        self.overflowed = False

    def put(self, item) -> None:
        """From any thread."""
        if not self.loop.is_closed():  # a stopped server's late deltas have nobody to go to
            self.loop.call_soon_threadsafe(self._put, item)

    def _put(self, item) -> None:
        if self.overflowed:
            return
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            self.overflowed = True
            while not self._queue.empty():  # drop what the slow reader never read; the request is aborted
                self._queue.get_nowait()
            self._queue.put_nowait(OVERFLOW)

    async def get(self, timeout_s: float):
        """The next item, or asyncio.TimeoutError after `timeout_s`."""
        if not self._queue.empty():  # what has arrived goes first, even at a timeout of 0
            return self._queue.get_nowait()
        return await asyncio.wait_for(self._queue.get(), timeout_s)

    def qsize(self) -> int:
        return self._queue.qsize()
