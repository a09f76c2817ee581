"""What a connection may hold before it is a request: uvicorn's h11 protocol with a deadline for each
request head, and the connection limits of connection_table.py (per client address, in all, and the
share kept for connections that show a valid API key).

uvicorn closes a connection idle after a response (`timeout_keep_alive`), but not one that opens and
sends nothing, nor one that sends its head a byte at a time (slowloris): each held a socket and a file
descriptor for as long as the client liked. Here a request's head must arrive whole within
`header_timeout_s` of the connection opening or of the previous response ending; the body's own
deadline is the body guard's (body_guard.py), which knows the route. A connection a limit refuses gets a
503 naming the limit and is closed before anything of it is parsed; one closed to make room (it waited
with no request in progress) is closed without an answer, as the header deadline would have closed it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from cluster.frontend.http.connection_table import ConnectionTable

_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
         b"retry-after: 5\r\ncontent-length: %d\r\n\r\n%s")
_REFUSALS = {
    "per_client": b"too many open connections from this address (ingress.max_connections_per_client)",
    "full": b"too many open connections (ingress.max_connections)",
}


def _busy(reason: str) -> bytes:
    body = b'{"error": {"message": "%s", "type": "service_unavailable", "param": null, "code": 503}}' % _REFUSALS[reason]
    return _BUSY % (len(body), body)


def guarded_h11(header_timeout_s: float, table: ConnectionTable,
                has_key: Callable[[bytes | None], bool]) -> type[H11Protocol]:
    """uvicorn's h11 protocol with these limits (uvicorn.Config's `http`); `has_key`: whether an
    Authorization header's value is a valid API key."""

    class GuardedH11(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            refusal = table.admit(self, self.client[0] if self.client else None)
            if refusal is not None:
                transport.write(_busy(refusal))
                transport.close()
                return
            self._await_head()

        def handle_events(self) -> None:
            began = self.cycle
            super().handle_events()
            if self.cycle is not began and self.cycle is not None:  # a head arrived: a request is in progress
                authorization = next((v for k, v in self.headers if k == b"authorization"), None)
                table.busy(self, has_key(authorization))

        def on_response_complete(self) -> None:
            finished = self.cycle
            super().on_response_complete()  # may start a pipelined request's cycle at once
            if self.cycle is finished and not self.transport.is_closing():
                table.idle(self)
            self._await_head(finished)

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            table.closed(self)
            super().connection_lost(exc)

        def evict(self) -> None:
            """Closed to make room for a new connection while it waited with no request in progress."""
            if self._head_timer is not None:
                self._head_timer.cancel()
            self.transport.close()

        def _await_head(self, last_cycle=None) -> None:
            """A new head is due: a cycle other than `last_cycle` must have begun by the deadline."""
            if self._head_timer is not None:
                self._head_timer.cancel()
            if not self.transport.is_closing():
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_late, last_cycle)

        def _head_late(self, last_cycle) -> None:
            if self.cycle is not last_cycle or self.transport.is_closing():
                return  # a request began in time (its response re-arms the deadline)
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:  # mid-parse states where h11 has no clean close: just drop it
                pass
            self.transport.close()

    return GuardedH11
