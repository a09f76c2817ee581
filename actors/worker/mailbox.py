"""The worker's side of the scheduler's batched calls (actors/protocol/worker_commands.py): which
commands are this worker's, and the answers to a batch of reservations."""

from __future__ import annotations

import logging
from concurrent.futures import Future

log = logging.getLogger("tandem.worker")


def addressed(worker_id: str, command) -> bool:
    """A command for another worker is dropped (and logged), never run here."""
    if command.worker_id == worker_id:
        return True
    log.error("worker %s: dropped a %s addressed to worker %s", worker_id, type(command).__name__, command.worker_id)
    return False


def answers(futures: list[Future | None], timeout_s: float) -> tuple:
    """Each reservation's result in order; None (no room, as the scheduler reads it) where one failed:
    the scheduler places that request again, elsewhere if need be."""
    out = []
    for future in futures:
        try:
            out.append(None if future is None else future.result(timeout=timeout_s))
        except Exception:
            log.exception("a reservation failed")
            out.append(None)
    return tuple(out)
