"""How long the scheduler takes to decide, and what the control plane itself costs: for
`tandem bench control-plane` and people, never for control decisions."""

from __future__ import annotations

import resource
import time
from collections import deque
from dataclasses import dataclass

_SAMPLES_KEPT = 200_000


@dataclass(frozen=True)
class ControlPlaneStats:
    admitted: int  # admissions timed since the last reset
    decision_p50_s: float | None  # a submit's arrival at the scheduler to its attempt sent to its worker
    decision_p99_s: float | None
    decision_max_s: float | None
    cpu_s: float  # the scheduler process's CPU time since the last reset
    wall_s: float
    max_rss_bytes: int
    in_flight: int
    prefix_index_entries: int  # (block hash, worker) pairs
    workers: int
    worker_calls: int  # frames sent to workers since the last reset (batched per tick)
    worker_commands: int  # the commands they carried
    refused: int = 0  # refusals timed since the last reset
    refusal_p50_s: float | None = None  # a submit's arrival at the scheduler to its refusal
    refusal_p99_s: float | None = None


class DecisionClock:
    def __init__(self) -> None:
        self._samples: deque[float] = deque(maxlen=_SAMPLES_KEPT)
        self._refusals: deque[float] = deque(maxlen=_SAMPLES_KEPT)
        self._admitted = 0
        self._since = self._cpu_since = 0.0
        self._calls_since = self._commands_since = 0
        self._start(None)

    def decided(self, seconds: float) -> None:
        self._samples.append(seconds)
        self._admitted += 1

    def refused(self, seconds: float) -> None:
        self._refusals.append(seconds)

    def stats(self, reset: bool, in_flight: int, index_entries: int, workers: int, mail) -> ControlPlaneStats:
        ordered, refusals = sorted(self._samples), sorted(self._refusals)

        def pct(q: float, values: list[float] = ordered) -> float | None:
            return values[min(len(values) - 1, int(q * len(values)))] if values else None

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out = ControlPlaneStats(
            self._admitted, pct(0.5), pct(0.99), ordered[-1] if ordered else None,
            time.process_time() - self._cpu_since, time.monotonic() - self._since, rss, in_flight,
            index_entries, workers, mail.calls - self._calls_since, mail.commands - self._commands_since,
            len(refusals), pct(0.5, refusals), pct(0.99, refusals))
        if reset:
            self._start(mail)
        return out

    def _start(self, mail) -> None:
        self._samples.clear()
        self._refusals.clear()
        self._admitted = 0
        self._since, self._cpu_since = time.monotonic(), time.process_time()
        if mail is not None:
            self._calls_since, self._commands_since = mail.calls, mail.commands
