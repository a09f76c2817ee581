"""The engine's one record of a request, whatever it is doing: running, holding its KV for a decode
worker, or waiting for its KV to arrive from a prefill worker.

vLLM's worker keeps a request waiting for remote KV as a status in the same request map (and frees its
blocks late); tandem does the same: "reserved" and "handed off" are phases of one `EngineRequest`, not
entries of side tables, and a request has one key from the worker's command to the engine's blocks.
Only the engine (engine.py) creates, changes and drops these records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

from actors.engine.sequence import Sequence
from actors.protocol.handoff_phase import HandoffPhase, check_move


@dataclass
class EngineRequest:
    request_id: Hashable
    phase: HandoffPhase
    seqs: list[Sequence] = field(default_factory=list)  # RUNNING: every sample; HELD: the one; RESERVED: none
    reserved_tokens: int = 0  # RESERVED: the prompt tokens whose KV is coming
    tag: Any = None  # the caller's own context of the request (a worker's: the attempt it serves)

    @property
    def blocks_id(self) -> tuple[Hashable, int]:
        """The KV cache's key for the blocks of sample 0 (a reservation's, or a handed-off prompt's)."""
        return (self.request_id, 0)

    def done(self) -> bool:
        """A running request whose every sample has ended (and none is still to be forked)."""
        return (self.phase is HandoffPhase.RUNNING and not self.seqs[0].pending_forks
                and all(s.status.is_finished() for s in self.seqs))


class RequestMap:
    """Every request of one engine by its key: the only writer of `EngineRequest` records, through named
    transitions. The engine (requests in and out) and its step (samples forked, handed off, ended) call
    them; what a record's blocks and queues are stays with the KV cache and the batcher."""

    def __init__(self) -> None:
        self._records: dict[Hashable, EngineRequest] = {}

    # ---- transitions ----

    def add(self, record: EngineRequest) -> None:
        if record.request_id in self._records:
            raise ValueError(f"request_id {record.request_id!r} is already in the engine")
        self._records[record.request_id] = record

    def adopted(self, request_id: Hashable, seq: Sequence) -> None:
        """RESERVED -> RUNNING: its KV landed, and `seq` continues after the first token."""
        record = self._records[request_id]
        check_move(record.phase, HandoffPhase.RUNNING)
        record.phase, record.seqs, record.reserved_tokens = HandoffPhase.RUNNING, [seq], 0

    def forked(self, child: Sequence) -> None:
        self._records[child.request_id].seqs.append(child)

    def handed_off(self, seq: Sequence) -> EngineRequest:
        """RUNNING -> HELD: its prompt is computed and its first token drawn."""
        record = self._records[seq.request_id]
        check_move(record.phase, HandoffPhase.HELD)
        record.phase = HandoffPhase.HELD
        return record

    def sample_ended(self, seq: Sequence) -> EngineRequest:
        """One sample ended; the request is dropped once every sample has. Returns its record."""
        record = self._records[seq.request_id]
        if record.done():
            del self._records[seq.request_id]
        return record

    def pop(self, request_id: Hashable, phases: tuple[HandoffPhase, ...]) -> EngineRequest | None:
        """Drop the request if it is in one of `phases` (the caller ends its blocks and queues)."""
        record = self._records.get(request_id)
        if record is None or record.phase not in phases:
            return None
        del self._records[request_id]
        return record

    # ---- reading ----

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._records

    def __len__(self) -> int:
        return len(self._records)

    def get(self, request_id: Hashable) -> EngineRequest | None:
        return self._records.get(request_id)

    def records(self) -> list[EngineRequest]:
        return list(self._records.values())

    def sequences(self) -> list[Sequence]:
        return [seq for record in list(self._records.values()) for seq in record.seqs]
