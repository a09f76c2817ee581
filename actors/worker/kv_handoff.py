"""One rank's ends of the KV transport (`kv_transfer`): zmq by default, torch.distributed with a group.

A prefill rank sends, a decode rank receives, a colocated one does neither. In a tensor-parallel worker
every rank has its own ends over its own cache, which holds some of the model's KV heads: a prefill rank
sends each decode rank the heads both hold (the lowest prefill rank holding a replicated head sends
it), so no rank ever gathers another's heads. `HandoffEnds.join` tells every rank the others' endpoints.

Lease safety is not here: a receiver asks `admit` (the handoff table, or rank 0's piece desk) before a
byte is written, and reports each piece's outcome to `on_piece`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from actors.engine.model.parallel import TPComm
from actors.protocol.codec import decode_as, encode
from actors.protocol.messages import KvRankEndpoint
from actors.protocol.tp_messages import KvPiece, KvSendPlan, PieceEvent
from actors.worker.handoff_table import LeaseRefused
from actors.worker.piece_desk import DeskClient, PieceDesk
from kv_transfer.collective_transport import CollectiveKVReceiver, CollectiveKVSender, init_collective
from kv_transfer.page_format import HeadSlice, PageFormatError, PageSpec, TransferError, TransferHeader
from kv_transfer.zmq_transport import ZmqKVReceiver, ZmqKVSender

Admit = Callable[[KvPiece], None]
OnPiece = Callable[[PieceEvent], None]


class HandoffSender:
    def __init__(self, kv_caches, rank: int = 0, heads_by_rank: tuple[HeadSlice, ...] | None = None, group=None,
                 keys=None, shm: bool = True):
        """zmq by default (CURVE with `keys`; shared memory with receivers of this host if `shm`); with a
        collective `group` (from `init_collective`), torch.distributed. `heads_by_rank`: which heads each
        rank of this worker holds (None: one rank, every head)."""
        self.kv_caches = kv_caches
        self.spec = PageSpec.from_caches(kv_caches)
        heads_by_rank = heads_by_rank or (HeadSlice.whole(self.spec.num_kv_heads),)
        self.heads = heads_by_rank[rank]
        # Heads a lower rank also holds (replicated KV heads) are that rank's to send.
        self._own = [h for h in range(self.heads.first, self.heads.end)
                     if not any(s.first <= h < s.end for s in heads_by_rank[:rank])]
        self.rank = rank
        self.bytes_sent = 0
        self._sender = ZmqKVSender(keys=keys, shm=shm) if group is None else CollectiveKVSender(group)

    def send(self, plan: KvSendPlan) -> None:
        """This rank's pieces of a handoff; raises (TransferError, PageFormatError) on the first that fails."""
        for target in plan.targets:
            heads = [h for h in self._own if target.first_head <= h < target.first_head + target.num_heads]
            if not heads:
                continue
            piece = HeadSlice(heads[0], len(heads), self.heads.total)
            spec = dataclasses.replace(self.spec, num_kv_heads=piece.count)
            header = TransferHeader(f"{plan.lease_id}/{self.rank}", plan.lease_id, spec, plan.dest_block_ids,
                                    plan.note, piece)
            self._sender.send(target.endpoint, header, self.kv_caches, plan.src_block_ids, plan.timeout_s,
                              cache_heads=self.heads)
            self.bytes_sent += spec.transfer_nbytes(header.num_blocks)

    def close(self) -> None:
        self._sender.close()


class HandoffReceiver:
    """Writes admitted pieces into this rank's caches and reports each outcome to `on_piece`."""

    def __init__(self, kv_caches, rank: int, heads: HeadSlice, admit: Admit, on_piece: OnPiece,
                 transport: str, host: str, group=None, keys=None, shm: bool = True):
        self.rank, self._admit, self._on_piece = rank, admit, on_piece
        if group is None:
            self._receiver = ZmqKVReceiver(kv_caches, self._landed, self._failed, transport=transport, host=host,
                                           admit=self._check, keys=keys, heads=heads, shm=shm)
        else:
            self._receiver = CollectiveKVReceiver(kv_caches, self._landed, self._failed, group=group,
                                                  admit=self._check, heads=heads)
        self._receiver.start()

    def _piece(self, header: TransferHeader) -> KvPiece:
        return KvPiece(header.lease_id, self.rank, header.heads.first, header.heads.count, header.dest_block_ids)

    def _check(self, header: TransferHeader) -> None:
        self._admit(self._piece(header))

    def _landed(self, header: TransferHeader) -> None:
        nbytes = header.spec.transfer_nbytes(header.num_blocks)
        self._on_piece(PieceEvent(self._piece(header), "landed", note=header.note, nbytes=nbytes))

    def _failed(self, header: TransferHeader | None, exc: Exception) -> None:
        if header is None or isinstance(exc, LeaseRefused):  # bytes that name no lease; a piece already judged
            return
        stage = "refused" if isinstance(exc, PageFormatError) else "failed"  # refused: no byte was written
        self._on_piece(PieceEvent(self._piece(header), stage, str(exc)))

    @property
    def endpoint(self) -> str:
        return self._receiver.endpoint

    @property
    def alive(self) -> bool:
        return self._receiver.alive

    @property
    def bytes_received(self) -> int:
        return self._receiver.stats().bytes_received

    def dropped(self) -> dict[str, int]:
        return self._receiver.drops.snapshot()

    def close(self) -> None:
        self._receiver.close()


@dataclasses.dataclass(frozen=True)
class _RankEnds:
    """What a rank tells the others when the group forms."""

    endpoint: str | None  # its KV receiver (decode)
    desk: str | None  # rank 0 of a decode group: its piece desk


class HandoffEnds:
    """A worker rank's sender and receiver for its role (`spec`, a WorkerSpec). Rank 0 passes the handoff
    table's `admit` and its own `on_piece`; the other ranks pass neither and go through rank 0's desk.
    With the collective backend the worker joins the cluster's group here (every worker joins at
    construction; Ray builds them concurrently, so the rendezvous completes)."""

    def __init__(self, spec, kv_caches, kv_heads: tuple[int, tuple[tuple[int, int], ...]], comm: TPComm,
                 admit: Admit | None = None, on_piece: OnPiece | None = None):
        total, by_rank = kv_heads
        self.heads_by_rank = tuple(HeadSlice(a, b - a, total) for a, b in by_rank)
        self.comm, self.rank = comm, comm.shard.rank
        group = None
        if spec.transfer_backend == "collective":
            group = init_collective(spec.collective_init, spec.rank, spec.world_size, device=spec.engine.device)
        keys = spec.curve_keys if spec.kv_encrypted else None
        self.sender = self.receiver = self.desk = self._desk_client = None
        if spec.role == "prefill":
            self.sender = HandoffSender(kv_caches, self.rank, self.heads_by_rank, group, keys, spec.kv_shm)
        if spec.role == "decode":
            if self.rank > 0:
                admit, on_piece = self._ask_desk, self._tell_desk
            elif comm.shard.size > 1:
                self.desk = PieceDesk(admit, on_piece)
            self.receiver = HandoffReceiver(kv_caches, self.rank, self.heads_by_rank[self.rank], admit, on_piece,
                                            spec.zmq_transport, spec.host, group, keys, spec.kv_shm)
        self.endpoints: tuple[KvRankEndpoint, ...] = ()

    def join(self) -> None:
        """Every rank of the worker calls this once, together: each learns the others' ends."""
        mine = _RankEnds(self.receiver.endpoint if self.receiver else None, self.desk.address if self.desk else None)
        ends = self.comm.agree(mine)
        if self.receiver is not None:
            self.endpoints = tuple(KvRankEndpoint(e.endpoint, h.first, h.count, h.total)
                                   for e, h in zip(ends, self.heads_by_rank))
            if self.rank > 0:
                self._desk_client = DeskClient(ends[0].desk)

    def hand_off(self, plan: KvSendPlan, lead: Callable[[bytes], None] | None = None) -> None:
        """Rank 0 of a prefill worker: every rank sends its part of `plan`; `lead` starts the other ranks'
        part (a step plan). Raises TransferError naming each rank whose part failed."""
        if lead is not None:
            lead(encode(plan))
        self._send_part(plan)

    def run_task(self, payload: bytes) -> None:
        """A rank r > 0 of a prefill worker: its part of a handoff rank 0 leads."""
        self._send_part(payload)

    def _send_part(self, plan: KvSendPlan | bytes) -> None:
        error = None
        try:  # whatever happens, every rank reaches `agree`: the ranks stay in step
            self.sender.send(plan if isinstance(plan, KvSendPlan) else decode_as(KvSendPlan, plan))
        except Exception as exc:
            error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        errors = [e for e in self.comm.agree(error) if e]
        if errors:
            raise TransferError("; ".join(errors))

    def bytes_moved(self) -> tuple[int, int]:
        """KV page bytes this rank has sent and received."""
        return (self.sender.bytes_sent if self.sender else 0), (self.receiver.bytes_received if self.receiver else 0)

    def _ask_desk(self, piece: KvPiece) -> None:
        if self._desk_client is None:
            raise LeaseRefused(f"transfer {piece.lease_id}: rank {self.rank} has not joined its group yet")
        self._desk_client.admit(piece)

    def _tell_desk(self, event: PieceEvent) -> None:
        self._desk_client.report(event)

    def close(self) -> None:
        for end in (self.receiver, self.sender, self.desk, self._desk_client):
            if end is not None:
                end.close()
