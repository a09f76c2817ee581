"""KV transfer over torch.distributed point-to-point send/recv (gloo on CPU, NCCL on CUDA).

Every worker of a set joins one process group (`init_collective`); a receiver's endpoint is its rank
("rank:3"). One transfer, sender -> receiver, in order:

1. preamble, tag 0, header group: int64 [MAGIC, header_nbytes, num_payloads, payload_nbytes];
2. header, tag 1, header group: the msgpack header (`encode_header`) as uint8;
3. payloads, tag 1, data group: for each layer the K pages then the V pages, each a uint8 tensor of
   `num_blocks * page_nbytes` bytes (bytes, so bfloat16 needs nothing special from the backend).

The receiving thread keeps one receive-from-any-rank posted on tag 0. Because the preamble carries
the payload count and sizes, the receiver can drain a transfer it refuses (into a scratch buffer)
without understanding its header, so the pair's stream stays in step.

Why the receiver polls the preamble buffer instead of waiting: in gloo, waiting on a receive with a
timeout that expires (and an untimed wait uses the group timeout) tears down every connection of
the group, so an idle receiver cannot wait. It watches the preamble's MAGIC word, which gloo writes
straight into the posted CPU tensor, and waits only once a transfer has arrived. That is why headers
always go over a gloo group: with NCCL, `init_collective` adds a gloo side group for preambles and
headers, and the pages go over NCCL.

Limits (honest):
- One group per worker set, created once per process; one `CollectiveKVReceiver` per process at a
  time. `close()` cannot cancel the posted receive-from-any (torch has no API for it); it is parked
  and the next receiver in the process adopts it, so no transfer is lost or misread.
- Point-to-point sends are rendezvous: `send` blocks until the receiver takes each piece, i.e. while
  it serves other senders. A `TransferError` (deadline passed, peer died) leaves the group in an
  unknown state: gloo closes its connections on a timed-out wait. Rebuild the group after one.
- A transfer that fails after its pages started arriving may leave dest blocks partly written
  (`on_error` is called; the blocks were reserved, so nobody reads them).
- The NCCL path is not exercised by the CPU tests; NCCL ignores tags and its waits do not honour
  `timeout_s`, and p2p traffic on the group NCCL uses for tensor parallelism can deadlock with it.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from kv_transfer.base import Admit, KVCaches, KVReceiver, KVSender, OnComplete, OnError
from kv_transfer.page_copy import gather_pages, scatter_pages
from kv_transfer.endpoints import advertised_host
from kv_transfer.page_format import (
    HeadSlice, PageFormatError, TransferError, TransferHeader, decode_header, encode_header,
)

MAGIC = int.from_bytes(b"TANDEMKV", "little")  # every byte non-zero: a half-written word never matches
_PREAMBLE_TAG, _BODY_TAG = 0, 1
_MAX_HEADER_NBYTES = 1 << 20
_MAX_PAYLOAD_NBYTES = 1 << 36


@dataclass(frozen=True)
class CollectiveGroup:
    """The process group(s) of one worker set, as seen from this process."""

    rank: int
    world_size: int
    header_group: dist.ProcessGroup  # always gloo: receive-from-any, CPU tensors
    data_group: dist.ProcessGroup  # gloo on CPU, NCCL on CUDA
    device: torch.device  # where payload tensors travel


def init_collective(init_method: str, rank: int, world_size: int, *, backend: str | None = None,
                    device: str | torch.device | None = None, timeout_s: float = 60.0) -> CollectiveGroup:
    """Join the worker set's group (call once per process, on every rank).

    init_method: "tcp://host:port" (torch's scheme: rank 0 hosts the rendezvous, so host must be rank
    0's address) or "store://host:port" (a rendezvous hosted elsewhere by `host_rendezvous`; every rank
    joins it as a client). The pages travel where the KV cache lives, `device`: NCCL for CUDA, gloo for
    CPU (None: CUDA when this process sees a GPU); `backend` overrides that choice."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                            **rendezvous_of(init_method, timeout))
    world = dist.group.WORLD
    if backend == "gloo":
        return CollectiveGroup(rank, world_size, world, world, torch.device("cpu"))
    cuda = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    torch.cuda.set_device(cuda)  # NCCL binds a communicator to the current device
    header_group = dist.new_group(backend="gloo", timeout=timeout)
    return CollectiveGroup(rank, world_size, header_group, world, cuda)


def host_rendezvous(bind_host: str, timeout_s: float = 300.0) -> tuple[dist.TCPStore, str]:
    """Host a worker set's rendezvous in this process (the driver), on a free port of `bind_host`.

    With torch's "tcp://" scheme rank 0 hosts it, so its address must be known before rank 0 is even
    placed; hosting it here needs only this node's address. Returns the store and the `init_method` to
    give every rank. The store is unauthenticated: the caller drops it (closing the port) as soon as
    the group has formed. A TCPStore master listens on every interface whatever host it is given, so
    the listening socket is made here, bound to `bind_host` only, and handed to it."""
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((bind_host if bind_host != "*" else "", 0))
        listener.listen(512)
        port = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    store = dist.TCPStore(bind_host, port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s), master_listen_fd=listener.detach())
    return store, f"store://{advertised_host(bind_host)}:{port}"


def rendezvous_of(init_method: str, timeout: timedelta) -> dict:
    """`init_process_group`'s rendezvous arguments for `init_method`: "store://host:port" joins one hosted
    by `host_rendezvous` as a client; any other scheme is torch's own."""
    scheme, _, address = init_method.partition("://")
    if scheme != "store":
        return {"init_method": init_method}
    host, _, port = address.rpartition(":")
    return {"store": dist.TCPStore(host, int(port), is_master=False, timeout=timeout)}


def rank_endpoint(rank: int) -> str:
    return f"rank:{rank}"


def _parse_endpoint(endpoint: str, group: CollectiveGroup) -> int:
    prefix, _, num = endpoint.partition(":")
    if prefix != "rank" or not num.isdigit() or not 0 <= int(num) < group.world_size or int(num) == group.rank:
        raise ValueError(f"endpoint {endpoint!r} is not 'rank:N' for another rank N of {group.world_size}")
    return int(num)


def _wait(work: dist.Work, deadline: float, what: str) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransferError(f"{what}: deadline passed")
    try:
        work.wait(timeout=timedelta(seconds=remaining))
    except RuntimeError as e:
        raise TransferError(f"{what}: {e}") from e


class CollectiveKVSender(KVSender):
    """Sends with torch.distributed p2p. Use from one thread at a time."""

    def __init__(self, group: CollectiveGroup):
        self.group = group

    def send(self, endpoint: str, header: TransferHeader, kv_caches: KVCaches,
             src_block_ids: Sequence[int], timeout_s: float, cache_heads: HeadSlice | None = None) -> None:
        dst = _parse_endpoint(endpoint, self.group)
        src, heads = self.check_send(header, kv_caches, src_block_ids, cache_heads)
        body = encode_header(header)
        preamble = torch.tensor([MAGIC, len(body), 2 * len(kv_caches), header.num_blocks * header.spec.page_nbytes],
                                dtype=torch.int64)
        deadline = time.monotonic() + timeout_s
        what = f"transfer {header.transfer_id} to {endpoint}"
        hg, dg = self.group.header_group, self.group.data_group
        _wait(dist.isend(preamble, dst, group=hg, tag=_PREAMBLE_TAG), deadline, what)
        _wait(dist.isend(torch.frombuffer(bytearray(body), dtype=torch.uint8), dst, group=hg, tag=_BODY_TAG),
              deadline, what)
        for k, v in kv_caches:
            for cache in (k, v):
                pages = gather_pages(cache, src, self.group.device, heads=heads)
                _wait(dist.isend(pages, dst, group=dg, tag=_BODY_TAG), deadline, what)

    def close(self) -> None:
        """Nothing to release: the group belongs to the process (`dist.destroy_process_group`)."""


# Receive-from-any that a closed receiver left posted, per header group: the next receiver adopts it.
_registry_lock = threading.Lock()
_parked: dict[int, tuple[dist.ProcessGroup, dist.Work, torch.Tensor]] = {}
_live: set[int] = set()


class CollectiveKVReceiver(KVReceiver):
    """Serves transfers addressed to this rank, one at a time, on a background thread."""

    def __init__(self, kv_caches: KVCaches, on_complete: OnComplete, on_error: OnError, *,
                 group: CollectiveGroup, poll_interval_s: float = 0.01, transfer_timeout_s: float = 30.0,
                 admit: Admit | None = None, heads: HeadSlice | None = None):
        super().__init__(kv_caches, on_complete, on_error, admit, heads)
        self.group = group
        self._poll_s = poll_interval_s
        self._transfer_timeout_s = transfer_timeout_s
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        self._in_flight: TransferHeader | None = None  # for the error report if the group fails mid-transfer
        self._key = id(group.header_group)

    @property
    def endpoint(self) -> str:
        return rank_endpoint(self.group.rank)

    def start(self) -> None:
        with _registry_lock:
            if self._key in _live:
                raise RuntimeError("a CollectiveKVReceiver is already running on this process group")
            _live.add(self._key)
            parked = _parked.pop(self._key, None)
        self._pending = parked[1:] if parked else self._post()
        self._start_thread(f"kv-recv-rank{self.group.rank}")

    def close(self) -> None:
        self._stop_thread(timeout_s=self._transfer_timeout_s + 5.0)
        with _registry_lock:
            if self._pending is not None and not (self._thread and self._thread.is_alive()):
                _parked[self._key] = (self.group.header_group, *self._pending)
                self._pending = None
            _live.discard(self._key)

    def _post(self) -> tuple[dist.Work, torch.Tensor]:
        preamble = torch.zeros(4, dtype=torch.int64)
        return dist.irecv(preamble, src=None, group=self.group.header_group, tag=_PREAMBLE_TAG), preamble

    def _run(self) -> None:
        while not self._stop.is_set():
            work, preamble = self._pending
            if int(preamble[0]) != MAGIC:
                self._stop.wait(self._poll_s)
                continue
            try:
                work.wait()  # the preamble is in; this returns at once
                src = dist.get_global_rank(self.group.header_group, work._source_rank())  # as dist.recv does
                self._pending = None
                self._serve(src, preamble.tolist())
                self._pending = self._post()
            except RuntimeError as e:  # TransferError included: the group is unusable from here on
                self._refuse(self._in_flight, TransferError(f"receiver stopped, process group unusable: {e}"))
                return

    def _serve(self, src: int, preamble: list[int]) -> None:
        _, header_nbytes, num_payloads, payload_nbytes = preamble
        deadline = time.monotonic() + self._transfer_timeout_s
        what = f"transfer from rank {src}"
        if not (0 < header_nbytes <= _MAX_HEADER_NBYTES and 0 <= num_payloads and 0 <= payload_nbytes
                <= _MAX_PAYLOAD_NBYTES):
            raise RuntimeError(f"corrupt preamble {preamble} from rank {src}; cannot drain it")
        body = torch.empty(header_nbytes, dtype=torch.uint8)
        _wait(dist.irecv(body, src, group=self.group.header_group, tag=_BODY_TAG), deadline, what)
        header = self._in_flight = None
        try:
            header = self._in_flight = decode_header(body.numpy().tobytes())
            dest = self._admit(header, [payload_nbytes] * num_payloads)
        except PageFormatError as e:
            self._drain(src, num_payloads, payload_nbytes, deadline, what)
            self._in_flight = None
            self._refuse(header, e)
            return
        pages = torch.empty(payload_nbytes, dtype=torch.uint8, device=self.group.device)
        heads = self._heads_of(header)
        for k, v in self.kv_caches:
            for cache in (k, v):
                _wait(dist.irecv(pages, src, group=self.group.data_group, tag=_BODY_TAG), deadline, what)
                scatter_pages(cache, dest, pages, heads)
        self._in_flight = None
        self._complete(header)

    def _drain(self, src: int, num_payloads: int, payload_nbytes: int, deadline: float, what: str) -> None:
        scratch = torch.empty(payload_nbytes, dtype=torch.uint8, device=self.group.device)
        for _ in range(num_payloads):
            _wait(dist.irecv(scratch, src, group=self.group.data_group, tag=_BODY_TAG), deadline, what)
