"""What a connection may hold before it is a request: uvicorn's h11 protocol with a deadline for each
request head and a cap on one client's open connections.

uvicorn closes a connection idle after a response (`timeout_keep_alive`), but not one that opens and
sends nothing, nor one that sends its head a byte at a time (slowloris): each held a socket and a file
descriptor for as long as the client liked. Here a request's head must arrive whole within
`header_timeout_s` of the connection opening or of the previous response ending; the body's own
deadline is the body guard's (body_guard.py), which knows the route. A client address past
`max_per_client` open connections gets a 503 and is closed before anything of it is parsed.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
         b"retry-after: 5\r\ncontent-length: %d\r\n\r\n%s")
_BUSY_BODY = (b'{"error": {"message": "too many open connections from this address (ingress.max_connections_per_client)",'
              b' "type": "service_unavailable", "param": null, "code": 503}}')


def guarded_h11(header_timeout_s: float, max_per_client: int | None) -> type[H11Protocol]:
    """uvicorn's h11 protocol with these limits (uvicorn.Config's `http`)."""

    class GuardedH11(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            host = self.client[0] if self.client else None
            if max_per_client is not None and host is not None:
                # `connections` holds this one too; counted per connection made, so never more than the cap stay.
                held = sum(1 for c in self.connections if c.client and c.client[0] == host)
                if held > max_per_client:
                    transport.write(_BUSY % (len(_BUSY_BODY), _BUSY_BODY))
                    transport.close()
                    return
            self._await_head()

        def on_response_complete(self) -> None:
            finished = self.cycle
            super().on_response_complete()  # may start a pipelined request's cycle at once
            self._await_head(finished)

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

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
