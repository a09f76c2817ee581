"""A worker's pulse: the scheduler hears that the process lives while its engine thread is busy.

Reports leave the engine thread between steps (actor.py), so a step longer than the heartbeat timeout (a
2048-token prefill of SmolLM2-135M takes ~9 s on one core of a 2-core box, more beside other load) would
look like a dead worker. The pulse runs on a thread of its own: whenever the engine thread has sent
nothing for `every_s`, it sends a `WorkerPulse`. Liveness then no longer depends on step length; an engine
thread that never comes back is judged by the time since its last report against the progress bound (the
scheduler's registry.py).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from actors.protocol.messages import WorkerPulse


class Pulse:
    def __init__(self, worker_id: str, incarnation: str, send: Callable[[WorkerPulse], None], every_s: float = 0.25):
        self._worker_id, self._incarnation, self._send, self._every_s = worker_id, incarnation, send, every_s
        # Written by the engine thread, read here: a float store and load need no lock.
        self._last_report = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pulse-{worker_id}", daemon=True)
        self._thread.start()

    def reported(self) -> None:
        """The engine thread just sent a report."""
        self._last_report = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            if time.monotonic() - self._last_report < self._every_s:
                continue
            try:
                self._send(WorkerPulse(self._worker_id, self._incarnation))
            except Exception:  # the scheduler is away or restarting: the next pulse tries again
                pass
