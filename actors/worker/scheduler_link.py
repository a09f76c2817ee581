"""A worker's line to the global scheduler: registration, reports, and registering again when the
scheduler no longer knows it (it restarted, or its watchdog gave up on this worker during a stall).

Everything is fire-and-forget: the engine thread never waits on the scheduler. The reply to a report
is only looked at on the next one; "unknown worker" (False) makes the worker register again with
every request it still holds, so a restarted scheduler can rebuild its view.
"""

from __future__ import annotations

from typing import Callable

import ray

from actors.protocol.messages import LiveRequest, WorkerInfo, WorkerReport


class SchedulerLink:
    def __init__(self, scheduler, worker_id: str, info: Callable[[], WorkerInfo],
                 live: Callable[[], list[LiveRequest]]):
        self.scheduler, self.worker_id = scheduler, worker_id
        self._info, self._live = info, live
        self._last_report = None  # the previous report's reply: False means "register again"
        self._registering = None

    def register(self) -> None:
        handle = ray.get_runtime_context().current_actor
        self._registering = self.scheduler.register.remote(self._info(), handle, self._live())

    def report(self, report: WorkerReport) -> None:
        if self._forgotten():
            self.register()
        self._last_report = self.scheduler.reports.remote((report,))  # the one report path, simulated fleets' too

    def _forgotten(self) -> bool:
        if self._last_report is None or (self._registering is not None and not _done(self._registering)):
            return False
        if not _done(self._last_report):
            return False
        try:
            (known,) = ray.get(self._last_report, timeout=0)
        except Exception:  # the scheduler is down or restarting: keep reporting until it answers
            return False
        self._last_report = None
        return known is False


def _done(ref) -> bool:
    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)
