"""The worker's side of the scheduler's batched calls (actors/protocol/worker_commands.py): which
commands are this worker's, and the answers to a batch of reservations."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

log = logging.getLogger("tandem.worker")


def addressed(worker_id: str, command) -> bool:
    """A command for another worker is dropped (and logged), never run here."""
    if command.worker_id == worker_id:
        return True
    log.error("worker %s: dropped a %s addressed to worker %s", worker_id, type(command).__name__, command.worker_id)
    return False


def gathered(futures: list[Future | None]) -> Future:
    """A future of every reservation's result in order, done when the last one is; None (no room, as the
    scheduler reads it) where one failed or was not this worker's: the scheduler places that request
    again, elsewhere if need be."""
    out: Future = Future()
    left = [sum(f is not None for f in futures)]
    lock = threading.Lock()

    def one_done(_future: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            out.set_result(tuple(_result(f) for f in futures))

    if not left[0]:
        out.set_result((None,) * len(futures))
    for future in futures:
        if future is not None:
            future.add_done_callback(one_done)
    return out


def _result(future: Future | None):
    if future is None:
        return None
    try:
        return future.result()
    except Exception:
        log.exception("a reservation failed")
        return None
