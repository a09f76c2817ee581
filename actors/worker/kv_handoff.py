"""The worker's side of the KV handoff: the transport plus lease safety.

The transport (`kv_transfer`) writes pages into whatever destination blocks a header names. A worker
must never let that happen to blocks whose reservation has expired (they may already belong to
another request), so the receiver here asks the worker to `accept` each transfer before a byte is
written, and an expiring reservation is refused while its pages are being written (`begin_expiry`).
"""

from __future__ import annotations

import threading
from typing import Callable

from kv_transfer.collective_transport import CollectiveKVReceiver, CollectiveKVSender
from kv_transfer.page_format import PageFormatError, PageSpec, TransferHeader
from kv_transfer.zmq_transport import ZmqKVReceiver, ZmqKVSender


class HandoffSender:
    def __init__(self, kv_caches, group=None):
        """zmq by default; with a collective `group` (from `init_collective`), torch.distributed."""
        self.kv_caches = kv_caches
        self.spec = PageSpec.from_caches(kv_caches)
        self._sender = ZmqKVSender() if group is None else CollectiveKVSender(group)

    def send(self, endpoint: str, transfer_id: str, lease_id: str, src_block_ids: list[int],
             dest_block_ids: list[int], extra: dict, timeout_s: float) -> None:
        header = TransferHeader(transfer_id, lease_id, self.spec, tuple(dest_block_ids), extra)
        self._sender.send(endpoint, header, self.kv_caches, src_block_ids, timeout_s)

    def close(self) -> None:
        self._sender.close()


class HandoffReceiver:
    """Receives pages for live reservations only; `on_pages(header, error)` reports each outcome."""

    def __init__(self, kv_caches, accept: Callable[[TransferHeader], bool],
                 on_pages: Callable[[TransferHeader | None, Exception | None], None],
                 transport: str, host: str, group=None):
        self._accept = accept
        self._on_pages = on_pages
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()
        self._expired: set[str] = set()
        done, failed = (lambda h: self._done(h, None)), (lambda h, e: self._done(h, e))
        if group is None:
            self._receiver = ZmqKVReceiver(kv_caches, done, failed, transport=transport, host=host, admit=self._admit)
        else:
            self._receiver = CollectiveKVReceiver(kv_caches, done, failed, group=group, admit=self._admit)
        self._receiver.start()

    @property
    def endpoint(self) -> str:
        return self._receiver.endpoint

    def begin_expiry(self, transfer_id: str) -> bool:
        """Claim an expiring reservation: False while its pages are being written (try again later)."""
        with self._lock:
            if transfer_id in self._in_flight:
                return False
            self._expired.add(transfer_id)
            return True

    def close(self) -> None:
        self._receiver.close()

    # called by the receiver thread, after the format checks and before any byte is written
    def _admit(self, header: TransferHeader) -> None:
        with self._lock:
            if header.transfer_id in self._expired or not self._accept(header):
                raise PageFormatError(f"transfer {header.transfer_id}: no live reservation for these blocks")
            self._in_flight.add(header.transfer_id)

    def _done(self, header: TransferHeader | None, error: Exception | None) -> None:
        if header is not None:
            with self._lock:
                self._in_flight.discard(header.transfer_id)
        self._on_pages(header, error)
