"""What the scheduler tells workers, batched: one zmq frame per worker process per scheduler tick
carries every command for the workers that process hosts (one for a real worker, many for a process of
simulated ones), to the process's command port (actors/worker/command_port.py). Each command names its
worker, so a process hosting several dispatches by id, and a real worker drops (and logs) a command for
another worker instead of running it.

Fire-and-forget commands go in `Commands`; reservations, which the scheduler awaits, in `Reserve`
(answered by `Reserved`, in the order asked). Tagged msgspec structs: a union of them travels.
"""

from __future__ import annotations

import msgspec

from actors.protocol.ids import AttemptId
from actors.protocol.messages import KvReservation, WorkerRequest


class SubmitAttempt(msgspec.Struct, frozen=True, tag=True):
    worker_id: str
    request: WorkerRequest


class ReleaseAttempt(msgspec.Struct, frozen=True, tag=True):
    """The decode side adopted the pages: the prefill worker frees its held copy."""

    worker_id: str
    attempt: AttemptId


class AbortAttempt(msgspec.Struct, frozen=True, tag=True):
    worker_id: str
    attempt: AttemptId


class ReserveBlocks(msgspec.Struct, frozen=True, tag=True):
    """Set aside KV blocks for an attempt's pages (answered with a `KvReservation`, or None: no room)."""

    worker_id: str
    request: WorkerRequest


WorkerCommand = SubmitAttempt | ReleaseAttempt | AbortAttempt


class Commands(msgspec.Struct, frozen=True, tag=True):
    commands: tuple[WorkerCommand, ...]


class Reserve(msgspec.Struct, frozen=True, tag=True):
    ask: int  # the scheduler's number for this frame; its answer names it
    asks: tuple[ReserveBlocks, ...]


class Reserved(msgspec.Struct, frozen=True, tag=True):
    """The answers to a `Reserve`, in order: a reservation, or None (no room, or it failed)."""

    ask: int
    reservations: tuple[KvReservation | None, ...]


ToWorker = Commands | Reserve
