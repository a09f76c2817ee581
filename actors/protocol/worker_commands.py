"""What the scheduler tells workers, batched: one Ray call per worker process per scheduler tick
carries every command for the workers that process hosts (one for a real worker, many for a process of
simulated ones). Each command names its worker, so a process hosting several dispatches by id, and a
real worker drops (and logs) a command for another worker instead of running it.

Fire-and-forget commands go in `deliver`; reservations, which the scheduler awaits, in `reserve_many`
(answers in the order asked).
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.protocol.ids import AttemptId
from actors.protocol.messages import WorkerRequest


@dataclass(frozen=True)
class SubmitAttempt:
    worker_id: str
    request: WorkerRequest


@dataclass(frozen=True)
class ReleaseAttempt:
    """The decode side adopted the pages: the prefill worker frees its held copy."""

    worker_id: str
    attempt: AttemptId


@dataclass(frozen=True)
class AbortAttempt:
    worker_id: str
    attempt: AttemptId


@dataclass(frozen=True)
class ReserveBlocks:
    """Set aside KV blocks for an attempt's pages (answered with a `KvReservation`, or None: no room)."""

    worker_id: str
    request: WorkerRequest


WorkerCommand = SubmitAttempt | ReleaseAttempt | AbortAttempt
