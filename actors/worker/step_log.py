"""The worker's recent engine steps, timed end to end: for the cost model to be fitted on what a worker
really does per step, not on `Engine.step` alone.

A step's `period_s` runs from its start to the start of the next step, or to the moment the engine
thread found no more work and began to wait: it includes what the worker does between steps (sending the
tokens out, taking in commands, reporting) and the neighbours it shares the machine with, which an
in-process engine profile never sees. `engine_s` is `Engine.step` alone.

Written by the engine thread, read by the actor's method thread: one lock, held for an append or a copy.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import NamedTuple

from actors.engine.step_shape import StepShape

KEEP = 8192  # steps; the oldest go first


class StepRecord(NamedTuple):
    """One logged step: its shape (StepShape's fields), then its seconds."""

    prefill_tokens: int
    prefill_pairs: int
    prefill_samples: int
    decode_seqs: int
    decode_context: int
    engine_s: float  # Engine.step alone
    period_s: float  # start to the next step's start, or to the wait


FIELDS = StepRecord._fields


class StepLog:
    def __init__(self, keep: int = KEEP):
        self._done: deque[StepRecord] = deque(maxlen=keep)
        self._open: tuple | None = None  # (shape, started, engine_s) of the step whose period runs
        self._lock = threading.Lock()
        self.total = 0  # steps ever closed (a reader can tell how many it missed)

    def started(self, at: float) -> None:
        """A step starts: the one before it ends its period here."""
        self.idle(at)

    def idle(self, at: float) -> None:
        """The engine thread is about to wait for work: the last step's period ends here."""
        if self._open is None:
            return
        shape, began, engine_s = self._open
        self._open = None
        with self._lock:
            self._done.append(StepRecord(*shape, engine_s, max(at - began, engine_s)))
            self.total += 1

    def ran(self, shape: StepShape, began: float, engine_s: float) -> None:
        self._open = (shape, began, engine_s)

    def records(self, since: int = 0) -> tuple[int, list[StepRecord]]:
        """(steps ever closed, the kept ones closed after the first `since`, oldest first, each as FIELDS)."""
        with self._lock:
            fresh = min(max(self.total - since, 0), len(self._done))
            return self.total, list(self._done)[len(self._done) - fresh:]
