"""The worker's ends of the KV transport (`kv_transfer`): zmq by default, torch.distributed with a group.

Lease safety is not here: the receiver asks the handoff table to `admit` each transfer before a byte is
written (the table alone knows which reservations are live), and reports each outcome to `on_pages`.
"""

from __future__ import annotations

from typing import Callable

from kv_transfer.collective_transport import CollectiveKVReceiver, CollectiveKVSender, init_collective
from kv_transfer.curve import CurveKeys
from kv_transfer.page_format import PageSpec, TransferHeader
from kv_transfer.zmq_transport import ZmqKVReceiver, ZmqKVSender


class HandoffSender:
    def __init__(self, kv_caches, group=None, keys: CurveKeys | None = None):
        """zmq by default (CURVE with `keys`); with a collective `group` (from `init_collective`),
        torch.distributed."""
        self.kv_caches = kv_caches
        self.spec = PageSpec.from_caches(kv_caches)
        self._sender = ZmqKVSender(keys=keys) if group is None else CollectiveKVSender(group)

    def send(self, endpoint: str, lease_id: str, src_block_ids: list[int], dest_block_ids: tuple[int, ...],
             note: bytes, timeout_s: float) -> None:
        header = TransferHeader(lease_id, lease_id, self.spec, tuple(dest_block_ids), note)
        self._sender.send(endpoint, header, self.kv_caches, src_block_ids, timeout_s)

    def close(self) -> None:
        self._sender.close()


class HandoffReceiver:
    """Writes admitted transfers into the caches; `on_pages(header, error)` reports each outcome
    (`header` None: bytes that were not a header at all)."""

    def __init__(self, kv_caches, admit: Callable[[TransferHeader], None],
                 on_pages: Callable[[TransferHeader | None, Exception | None], None],
                 transport: str, host: str, group=None, keys: CurveKeys | None = None):
        done, failed = (lambda h: on_pages(h, None)), (lambda h, e: on_pages(h, e))
        if group is None:
            self._receiver = ZmqKVReceiver(kv_caches, done, failed, transport=transport, host=host, admit=admit,
                                           keys=keys)
        else:
            self._receiver = CollectiveKVReceiver(kv_caches, done, failed, group=group, admit=admit)
        self._receiver.start()

    @property
    def endpoint(self) -> str:
        return self._receiver.endpoint

    @property
    def alive(self) -> bool:
        return self._receiver.alive

    def dropped(self) -> dict[str, int]:
        return self._receiver.drops.snapshot()

    def close(self) -> None:
        self._receiver.close()


def handoff_ends(spec, kv_caches, admit: Callable[[TransferHeader], None],
                 on_pages: Callable[[TransferHeader | None, Exception | None], None]):
    """A worker's (sender, receiver) for its role (`spec`, a WorkerSpec): a prefill worker sends, a decode
    worker receives, a colocated one does neither. With the collective backend the worker joins the
    cluster's group here (every worker joins at construction; Ray builds them concurrently, so the
    rendezvous completes)."""
    group = None
    if spec.transfer_backend == "collective":
        group = init_collective(spec.collective_init, spec.rank, spec.world_size, device=spec.engine.device)
    keys = spec.curve_keys if spec.kv_encrypted else None
    sender = HandoffSender(kv_caches, group, keys) if spec.role == "prefill" else None
    receiver = None
    if spec.role == "decode":
        receiver = HandoffReceiver(kv_caches, admit, on_pages, spec.zmq_transport, spec.host, group, keys)
    return sender, receiver
