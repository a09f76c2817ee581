"""Every open HTTP connection of one ingress: counted per client address and in all, and by whether it has
shown a valid API key, so that a flood of connections cannot take the descriptors the tenants need.

Owner: this table, on the server's event loop thread (uvicorn's protocol callbacks; no lock). Its one
caller is the h11 protocol of connections.py, which reports each connection's life:
`admit` (opened; refused or let in, perhaps by closing another), `busy` (a request head arrived, with or
without a key), `idle` (its response ended; waiting for the next head) and `closed` (gone, however).

Limits, each kept in O(1) per event (a scan of the open connections per new one is what made a flood of
15k connections cost the event loop seconds):
- one client address holds at most `max_per_client` (the TCP peer: behind a proxy, every client is it);
- all connections together at most `max_open`, set below the process's open-file limit;
- connections that have not shown a valid key at most `max_open - keyed_reserve`: the rest is kept for
  tenants. A connection has shown no key until its first head arrives, so one that would exceed a limit
  first closes the longest-waiting connection that has no request in progress (keyless ones first, a
  keyed one only when all `max_open` are taken). A new connection sends its head within milliseconds,
  while a flood's connections wait; to crowd a tenant's connection out before its head arrives, a flood
  would have to open a whole share of connections in that time.
"""

from __future__ import annotations

from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class Closable(Protocol):
    def evict(self) -> None:
        """Close at once; the table has already forgotten it."""


class ConnectionTable:
    def __init__(self, max_open: int, keyed_reserve: int, max_per_client: int | None):
        if not 0 <= keyed_reserve < max_open:
            raise ValueError(f"keyed_reserve {keyed_reserve} must be below max_open {max_open}")
        self.max_open = max_open
        self.keyless_max = max_open - keyed_reserve
        self.max_per_client = max_per_client
        self._host: dict[Closable, str | None] = {}  # every open connection -> its client address
        self._per_client: dict[str, int] = {}
        self._keyed: set[Closable] = set()
        # connections with no request in progress, longest-waiting first (a dict keeps insertion order)
        self._waiting_keyless: dict[Closable, None] = {}
        self._waiting_keyed: dict[Closable, None] = {}
        self.refused = {"per_client": 0, "full": 0}
        self.evicted = 0

    @property
    def open(self) -> int:
        return len(self._host)

    @property
    def keyless(self) -> int:
        return len(self._host) - len(self._keyed)

    def admit(self, conn: Closable, host: str | None) -> str | None:
        """Let `conn` in (None), perhaps closing a waiting one for it, or say which limit refuses it."""
        if self.max_per_client is not None and host is not None and self._per_client.get(host, 0) >= self.max_per_client:
            self.refused["per_client"] += 1
            return "per_client"
        if self.keyless >= self.keyless_max or self.open >= self.max_open:
            victim = next(iter(self._waiting_keyless), None)
            if victim is None and self.open >= self.max_open:
                victim = next(iter(self._waiting_keyed), None)
            if victim is not None:
                self.closed(victim)
                self.evicted += 1
                victim.evict()
            elif self.open >= self.max_open:
                self.refused["full"] += 1
                return "full"
            # else: the keyless share is all requests in progress; the reserve takes it, as it may hold a key
        self._host[conn] = host
        if host is not None:
            self._per_client[host] = self._per_client.get(host, 0) + 1
        self._waiting_keyless[conn] = None
        return None

    def busy(self, conn: Closable, keyed: bool) -> None:
        """A request head arrived on `conn`; `keyed`: it carried a valid API key (the connection stays keyed)."""
        if conn not in self._host:
            return  # evicted or refused: its transport is closing
        self._waiting_keyless.pop(conn, None)
        self._waiting_keyed.pop(conn, None)
        if keyed:
            self._keyed.add(conn)

    def idle(self, conn: Closable) -> None:
        if conn in self._host:
            (self._waiting_keyed if conn in self._keyed else self._waiting_keyless)[conn] = None

    def closed(self, conn: Closable) -> None:
        """Forget `conn` (idempotent: an evicted connection's own close comes later)."""
        if conn not in self._host:
            return
        host = self._host.pop(conn)
        if host is not None:
            left = self._per_client[host] - 1
            if left:
                self._per_client[host] = left
            else:
                del self._per_client[host]
        self._keyed.discard(conn)
        self._waiting_keyless.pop(conn, None)
        self._waiting_keyed.pop(conn, None)

    def check_integrity(self) -> dict:
        per_client = sum(self._per_client.values())
        with_host = sum(1 for h in self._host.values() if h is not None)
        waiting = len(self._waiting_keyless) + len(self._waiting_keyed)
        if (per_client != with_host or not self._keyed <= self._host.keys() or waiting > self.open
                or any(c in self._keyed for c in self._waiting_keyless)
                or not all(c in self._keyed for c in self._waiting_keyed)
                or self.open > self.max_open or any(n <= 0 for n in self._per_client.values())):
            raise RuntimeError(f"connection table: open {self.open} (max {self.max_open}), keyed {len(self._keyed)}, "
                               f"per-client sum {per_client} vs {with_host} with an address, waiting "
                               f"{len(self._waiting_keyless)} keyless + {len(self._waiting_keyed)} keyed")
        return {"open": self.open, "keyed": len(self._keyed), "waiting": waiting, "clients": len(self._per_client),
                "refused": dict(self.refused), "evicted": self.evicted}


class ConnectionCollector(Collector):
    """`tandem:ingress_connections` (open, by keyed) and `tandem:ingress_connections_closed` (by limit) on /metrics."""

    def __init__(self, table: ConnectionTable) -> None:
        self._table = table

    def collect(self):
        t = self._table
        open_ = GaugeMetricFamily("tandem:ingress_connections", "open HTTP connections, by whether they showed a "
                                  "valid API key", labels=["keyed"])
        open_.add_metric(["true"], t.open - t.keyless)
        open_.add_metric(["false"], t.keyless)
        closed = CounterMetricFamily("tandem:ingress_connections_closed", "connections closed by a connection limit: "
                                     "refused on arrival (per_client, full) or closed while waiting to make room "
                                     "(evicted)", labels=["reason"])
        for reason, n in (*t.refused.items(), ("evicted", t.evicted)):
            closed.add_metric([reason], n)
        yield from (open_, closed)
