"""What the scheduler tells workers and clients. Every command is fire-and-forget and idempotent where it
lands (a worker ignores an abort or release for an attempt it does not hold), so a lost or repeated
command costs nothing but the lease that would have ended it anyway. Commands to workers travel
batched per tick, over zmq to each worker process's command port (worker_mail.py)."""

from __future__ import annotations

import logging


from actors.protocol.ids import AttemptId
from actors.protocol.messages import KvReservation, TokenDelta, WorkerRequest
from actors.protocol.token_stream import TokenPublisher
from actors.protocol.worker_commands import AbortAttempt, ReleaseAttempt, ReserveBlocks, WorkerCommand
from cluster.control.scheduler.registry import WorkerRegistry
from cluster.control.scheduler.scheduler_state import Tracked
from cluster.control.scheduler.worker_mail import MailLost, WorkerMail
from kv_transfer.curve import CurveKeys

log = logging.getLogger("tandem.scheduler")


class Outbox:
    def __init__(self, registry: WorkerRegistry, mail: WorkerMail, curve_keys: CurveKeys | None):
        self._registry, self.mail = registry, mail
        # Only to tell a client its request failed with a lost worker, or that an attempt of it is stale.
        self._publisher = TokenPublisher(keys=curve_keys)

    async def reserve(self, endpoint: str, request: WorkerRequest, worker_id: str) -> KvReservation | None:
        """The prompt's blocks on a decode worker (its process's command endpoint); None if it cannot answer
        (dying or restarting: the caller tries again, elsewhere, until its admission deadline)."""
        try:
            return await self.mail.reserve(endpoint, ReserveBlocks(worker_id, request))
        except MailLost as exc:
            log.warning("reserve on %s failed: %s", worker_id, exc)
            self.mail.send(endpoint, AbortAttempt(worker_id, request.attempt))  # in case it landed after all
            return None

    def abort(self, tracked: Tracked, skip: str | None = None) -> None:
        """Stop the attempt on every worker that may hold state for it."""
        for wid in tracked.workers - {skip}:
            self.abort_on(wid, tracked.attempt)

    def abort_on(self, worker_id: str, attempt: AttemptId) -> None:
        self.send(worker_id, AbortAttempt(worker_id, attempt))

    def send(self, worker_id: str, command: WorkerCommand) -> None:
        """To a registered worker (a command for one that is gone has nobody to do it)."""
        entry = self._registry.get(worker_id)
        if entry is not None:
            self.mail.send(entry.info.command_endpoint, command)

    def release_on(self, worker_id: str, attempt: AttemptId, role: str | None = None) -> None:
        entry = self._registry.get(worker_id)
        if entry is not None and (role is None or entry.view.role == role):
            self.mail.send(entry.info.command_endpoint, ReleaseAttempt(worker_id, attempt))

    def tell_client(self, tracked: Tracked, message: str, retryable: bool = True) -> None:
        delta = TokenDelta.failure(WorkerRequest(tracked.attempt, tracked.request), message, retryable)
        self._publisher.publish(tracked.request.sink, [delta])

    def tell_superseded(self, tracked: Tracked) -> None:
        """The attempt was placed again without its client: what still comes from it is stale there."""
        self._publisher.publish(tracked.request.sink, [TokenDelta.stale(tracked.attempt)])
