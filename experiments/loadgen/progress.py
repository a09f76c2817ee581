"""A one-line progress bar on stderr, redrawn at most ten times a second; only on a terminal, since
carriage returns in a log file are noise."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int | None, label: str, enabled: bool = True, stream=sys.stderr):
        self.total, self.label, self.stream = total, label, stream
        self.enabled = enabled and stream.isatty()
        self.done = self.failed = self.in_flight = 0
        self._start = time.perf_counter()
        self._last_draw = 0.0

    def started(self) -> None:
        self.in_flight += 1
        self._draw()

    def finished(self, ok: bool) -> None:
        self.in_flight -= 1
        self.done += 1
        self.failed += not ok
        self._draw()

    def close(self) -> None:
        self._draw(force=True)
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not force and now - self._last_draw < 0.1):
            return
        self._last_draw = now
        if self.total:
            filled = int(30 * self.done / self.total)
            bar = f"[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}"
        else:
            bar = f"{self.done} done"
        line = f"\r{self.label} {bar}  in flight {self.in_flight}  failed {self.failed}  {now - self._start:5.1f} s"
        self.stream.write(line)
        self.stream.flush()
