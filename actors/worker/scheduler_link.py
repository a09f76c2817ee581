"""A worker's line to the global scheduler: registration (through Ray), reports (over zmq,
report_link.py), and registering again when the scheduler no longer knows it (it restarted, or its
watchdog gave up on this worker during a stall).

Nothing here waits on the scheduler: the engine thread asks `ready` before it builds a report, and a
report's answer is only looked at before the next one. "Unknown worker" makes the worker register
again with every request it still holds, so a restarted scheduler can rebuild its view.
"""

from __future__ import annotations

from typing import Callable

import ray

from actors.protocol.messages import LiveRequest, WorkerInfo, WorkerReport
from actors.worker.report_link import ReportLink
from kv_transfer.curve import CurveKeys


class SchedulerLink:
    def __init__(self, scheduler, worker_id: str, info: Callable[[], WorkerInfo],
                 live: Callable[[], list[LiveRequest]], keys: CurveKeys | None):
        self.scheduler, self.worker_id = scheduler, worker_id
        self._info, self._live = info, live
        self._reports = ReportLink(scheduler, keys)
        self._registering = None

    def register(self) -> None:
        handle = ray.get_runtime_context().current_actor
        self._registering = self.scheduler.register.remote(self._info(), handle, self._live())

    def ready(self) -> bool:
        """Whether a report may go now: build one only then (what it carries stays queued meanwhile)."""
        return self._reports.ready()

    def report(self, report: WorkerReport) -> None:
        forgotten = self.worker_id in self._reports.take_unknown()
        if forgotten and (self._registering is None or _done(self._registering)):
            self.register()
        self._reports.send((report,))  # the one report path, simulated fleets' too

    def close(self) -> None:
        self._reports.close()


def _done(ref) -> bool:
    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)
