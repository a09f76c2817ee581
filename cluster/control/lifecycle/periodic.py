"""A daemon thread that runs one step every interval until stopped (the config watcher, the autoscaler).

A step that raises is handed to its owner's `on_error` (which says what was not done), and the next
interval runs as usual: the cluster keeps serving at its size whatever one step met.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Periodic:
    def __init__(self, name: str, interval_s: float, step: Callable[[], object], on_error: Callable[[Exception], None]):
        self.interval_s = interval_s
        self._step, self._on_error = step, on_error
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._step()
            except Exception as exc:
                self._on_error(exc)
