"""The KV transfer contract: a sender pushes pages of its cache into reserved blocks of a receiver's cache.

Who calls what
- The prefill side owns a `KVSender` and calls `send(endpoint, header, kv_caches, src_block_ids,
  timeout_s, cache_heads)` once per handoff (or per head slice of one), from one thread at a time.
- The decode side owns a `KVReceiver(kv_caches, on_complete, on_error, heads=...)`, calls `start()` once, publishes
  `endpoint` (through the control plane) to the senders, and calls `close()` when it shuts down.
- The receiver calls the optional `admit(header)` from its own thread for each transfer whose format
  checks passed, before any byte is written: the caller's last word (e.g. "is this lease still
  live?"); raising `PageFormatError` refuses the transfer like a format error.
- The receiver calls `on_complete(header)` or `on_error(header_or_None, exc)` from its own thread,
  once per incoming transfer. Callbacks should be quick (hand off to a queue); an exception they
  raise is logged and swallowed, it never stops the receiver.

Promises
- `send` validates first: if `header.spec` does not describe `kv_caches`, or `src_block_ids` does not
  match `header.dest_block_ids` in length or names a block that does not exist, it raises
  `PageFormatError` (a `ValueError`) and sends nothing.
- `send` returns only after every byte of the transfer is handed to the transport (it has its own copy
  or reference of the gathered pages, so the caller may reuse the source blocks at once), or raises
  `TransferError` by `timeout_s`. Returning is not delivery: the lease's ack (control plane) is.
- The receiver writes the pages into `header.dest_block_ids` of its caches (source block i goes to
  destination block i; with a head slice, only those heads of each block) and only THEN calls
  `on_complete(header)`. It writes no other block.
- Head slices (tensor-parallel workers, whose caches each hold some of the model's KV heads): the
  sender's `cache_heads` says which heads its caches hold, the header's `heads` which of them it sends
  (they must lie inside); the receiver's `heads` says which heads its caches hold, and it refuses a
  slice that does not lie inside them.
- On a spec mismatch, destination ids outside its pool, wrong page sizes or a header it cannot decode,
  the receiver writes NOTHING into its caches and calls `on_error(header, exc)` (`header` is None if
  it could not be decoded) with a `PageFormatError` that says what was wrong, then keeps serving.
  Nothing is allocated for a transfer before its header passed these checks.
- Every message the receiver throws away is counted by reason in `drops` (`kv_transfer.drops`); no
  message, however malformed, stops the receiving thread. `alive` is False only once the thread has
  ended (closed, or killed on purpose by a chaos hook): its owner treats that as a failed process.
- The receiver never blocks forever: it waits for work with a poll timeout, so `close()` returns
  within about one poll interval (plus the transfer being written, if any). `close()` is idempotent.
- The receiver does not know about leases or requests: which blocks are reserved, when a lease
  expires and what to do with blocks of a failed transfer are the caller's business.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kv_transfer.drops import DropCounter
from kv_transfer.page_format import HeadSlice, PageFormatError, PageSpec, TransferHeader

logger = logging.getLogger(__name__)

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]
OnComplete = Callable[[TransferHeader], None]
OnError = Callable[[TransferHeader | None, Exception], None]
Admit = Callable[[TransferHeader], None]


@dataclass(frozen=True)
class ReceiverStats:
    transfers_ok: int
    transfers_refused: int  # refused (bad header, mismatch) or failed mid-way
    bytes_received: int  # page bytes written by successful transfers


class KVSender(ABC):
    """Pushes pages to receivers. Not thread-safe: use one sender from one thread at a time."""

    @abstractmethod
    def send(self, endpoint: str, header: TransferHeader, kv_caches: KVCaches,
             src_block_ids: Sequence[int], timeout_s: float, cache_heads: HeadSlice | None = None) -> None:
        """Push blocks `src_block_ids` of `kv_caches` (which hold `cache_heads` of the model; None: all its
        heads) to `header.dest_block_ids` at `endpoint`: the heads `header.heads` of each block."""

    @abstractmethod
    def close(self) -> None:
        """Release transport resources; idempotent."""

    @staticmethod
    def check_send(header: TransferHeader, kv_caches: KVCaches, src_block_ids: Sequence[int],
                   cache_heads: HeadSlice | None = None) -> tuple[torch.Tensor, tuple[int, int] | None]:
        """Validate a send before any byte leaves; returns the source block ids as an index tensor and
        which heads of the caches to send (offset, count; None: all of them)."""
        spec = PageSpec.from_caches(kv_caches)
        cache_heads = cache_heads or HeadSlice.whole(spec.num_kv_heads)
        if dataclasses.replace(spec, num_kv_heads=header.spec.num_kv_heads) != header.spec \
                or cache_heads.count != spec.num_kv_heads or not cache_heads.contains(header.heads):
            raise PageFormatError(f"transfer {header.transfer_id}: header.spec {header.spec} with {header.heads} "
                                  f"does not describe the caches being sent ({spec}, {cache_heads})")
        if len(src_block_ids) != header.num_blocks:
            raise PageFormatError(f"transfer {header.transfer_id}: {len(src_block_ids)} source blocks but "
                                  f"{header.num_blocks} destination blocks")
        num_blocks = kv_caches[0][0].shape[0]
        bad = [b for b in src_block_ids if not 0 <= b < num_blocks]
        if bad:
            raise PageFormatError(f"transfer {header.transfer_id}: source block ids {bad[:8]} outside the "
                                  f"sender's pool [0, {num_blocks})")
        src = torch.tensor(list(src_block_ids), dtype=torch.long, device=kv_caches[0][0].device)
        if header.heads == cache_heads:
            return src, None
        return src, (header.heads.first - cache_heads.first, header.heads.count)


class KVReceiver(ABC):
    """Writes incoming pages into reserved blocks of `kv_caches`; see the module docstring."""

    def __init__(self, kv_caches: KVCaches, on_complete: OnComplete, on_error: OnError, admit: Admit | None = None,
                 heads: HeadSlice | None = None):
        self.kv_caches = list(kv_caches)
        self.spec = PageSpec.from_caches(self.kv_caches)
        self.heads = heads or HeadSlice.whole(self.spec.num_kv_heads)  # which of the model's heads the caches hold
        if self.heads.count != self.spec.num_kv_heads:
            raise PageFormatError(f"receiver: {self.heads} but its caches hold {self.spec.num_kv_heads} KV heads")
        self.num_blocks = self.kv_caches[0][0].shape[0]
        self.device = self.kv_caches[0][0].device
        self._on_complete = on_complete
        self._on_error = on_error
        self._admit_hook = admit
        self._ok = self._refused = self._bytes = 0
        self.drops = DropCounter("kv_receiver")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @abstractmethod
    def start(self) -> None:
        """Bind and start the receiving thread; `endpoint` is valid afterwards."""

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """What a sender passes to `send` to reach this receiver."""

    @abstractmethod
    def close(self) -> None:
        """Stop receiving and release the transport; returns promptly; idempotent."""

    def stats(self) -> ReceiverStats:
        return ReceiverStats(self._ok, self._refused, self._bytes)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _start_thread(self, name: str) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{type(self).__name__} already started")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _stop_thread(self, timeout_s: float) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("%s: receiving thread still busy after %.1fs", type(self).__name__, timeout_s)

    @abstractmethod
    def _run(self) -> None:
        """The receiving loop; must return soon after `self._stop` is set."""

    def _check_header(self, header: TransferHeader) -> None:
        """What a header alone must satisfy before anything is allocated or written; raises PageFormatError."""
        header.spec.check_compatible(self.spec, ignore=("num_kv_heads",))
        if not self.heads.contains(header.heads):
            raise PageFormatError(f"transfer {header.transfer_id}: page format mismatch: sender sends {header.heads}, "
                                  f"receiver holds {self.heads}")
        dest = header.dest_block_ids
        bad = [b for b in dest if b >= self.num_blocks]
        if bad:
            raise PageFormatError(f"transfer {header.transfer_id}: dest block ids {bad[:8]} outside the "
                                  f"receiver's pool [0, {self.num_blocks})")
        if len(set(dest)) != len(dest):
            raise PageFormatError(f"transfer {header.transfer_id}: dest block ids repeat: {list(dest)[:16]}")

    def _admit(self, header: TransferHeader, page_sizes: Sequence[int]) -> torch.Tensor:
        """Check a header and the sizes of its page payloads before anything is written, then ask `admit`.

        Returns the destination ids as an index tensor; raises PageFormatError."""
        self._check_header(header)
        dest = header.dest_block_ids
        want = header.num_blocks * header.spec.page_nbytes
        if len(page_sizes) != 2 * self.spec.num_layers or any(n != want for n in page_sizes):
            raise PageFormatError(
                f"transfer {header.transfer_id}: expected {2 * self.spec.num_layers} page payloads of {want} bytes, "
                f"got {len(page_sizes)} of sizes {sorted(set(page_sizes))}")
        if self._admit_hook is not None:
            self._admit_hook(header)
        return torch.tensor(dest, dtype=torch.long, device=self.device)

    def _complete(self, header: TransferHeader) -> None:
        if self.device.type == "cuda":  # the writes are queued on a stream; finish them before saying so
            torch.cuda.current_stream(self.device).synchronize()
        self._ok += 1
        self._bytes += header.spec.transfer_nbytes(header.num_blocks)
        self._call(self._on_complete, header)

    def _heads_of(self, header: TransferHeader) -> tuple[int, int] | None:
        """Where an admitted header's heads lie in this receiver's caches (offset, count); None: all of them."""
        if header.heads == self.heads:
            return None
        return header.heads.first - self.heads.first, header.heads.count

    def _refuse(self, header: TransferHeader | None, exc: Exception) -> None:
        self._refused += 1
        reason = "malformed" if header is None else "refused" if isinstance(exc, PageFormatError) else "error"
        self.drops.drop(reason, exc)
        self._call(self._on_error, header, exc)

    @staticmethod
    def _call(callback: Callable, *args) -> None:
        try:
            callback(*args)
        except Exception:
            logger.exception("KV receiver callback %r raised; ignored", callback)
