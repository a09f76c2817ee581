"""The scheduler's worker registry: who is registered, their latest report, who is draining, who died.

One owner of the worker entries. Workers register themselves (again after a restart: a new
incarnation). A worker is declared lost as soon as Ray reports its process dead (`watch_process`), or
when its reports stop for the heartbeat timeout (`watch_heartbeats`); `on_lost(worker_id, why)` then
lets the scheduler deal with its requests. A worker declared lost while it was only stalled comes back
with the same incarnation: `was_declared_lost` tells the scheduler to stop its stale copies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import ray

from actors.protocol.messages import WorkerInfo, WorkerStats
from cluster.control.routing import WorkerView
from cluster.control.scheduler_state import WorkerEntry

log = logging.getLogger("tandem.scheduler")


class WorkerRegistry:
    def __init__(self, heartbeat_timeout_s: float, on_lost: Callable[[str, str], None]):
        self._workers: dict[str, WorkerEntry] = {}
        self._lost: dict[str, str] = {}  # worker id -> incarnation declared dead
        self._draining: set[str] = set()  # no new work; what they serve finishes
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._on_lost = on_lost
        self.workers_lost = 0

    def get(self, worker_id: str) -> WorkerEntry | None:
        return self._workers.get(worker_id)

    def ids(self) -> set[str]:
        return set(self._workers)

    def entries(self) -> dict[str, WorkerEntry]:
        return dict(self._workers)

    def views(self, role: str) -> list[WorkerView]:
        """The role's workers that take new work."""
        return [w.view for wid, w in self._workers.items() if w.view.role == role and wid not in self._draining]

    def is_current(self, worker_id: str, incarnation: str) -> bool:
        """Still registered as the same process (not forgotten, not replaced by its restarted self)."""
        entry = self._workers.get(worker_id)
        return entry is not None and entry.info.incarnation == incarnation

    def add(self, info: WorkerInfo, handle) -> tuple[WorkerEntry, bool]:
        """Register (or keep) a worker; True when the entry is new, and its process watch is started."""
        known = self._workers.get(info.worker_id)
        if known is not None:
            return known, False
        view = WorkerView(info.worker_id, info.role, info.num_blocks, info.num_blocks)
        entry = self._workers[info.worker_id] = WorkerEntry(handle, info, view)
        asyncio.get_running_loop().create_task(self._watch_process(info.worker_id, info.incarnation, handle))
        return entry, True

    def was_declared_lost(self, info: WorkerInfo) -> bool:
        """This very process was declared lost during a stall (and is registering again)."""
        return self._lost.pop(info.worker_id, None) == info.incarnation

    def observe(self, stats: WorkerStats) -> bool:
        """A report arrived; False when the worker is not registered (it should register again)."""
        entry = self._workers.get(stats.worker_id)
        if entry is None:
            return False
        entry.last_seen = time.monotonic()
        entry.stats = stats
        v = entry.view
        v.free_blocks, v.num_blocks = stats.free_blocks, stats.num_blocks
        v.running, v.waiting = stats.running, stats.waiting
        v.queued_prefill_tokens = stats.queued_prefill_tokens
        v.prefill_s_per_token = stats.prefill_s_per_token
        return True

    def drain(self, worker_id: str) -> None:
        if worker_id not in self._workers:
            raise ValueError(f"unknown worker {worker_id!r}")
        self._draining.add(worker_id)

    def draining(self) -> list[str]:
        return sorted(self._draining)

    def remove(self, worker_id: str) -> WorkerEntry | None:
        self._draining.discard(worker_id)
        return self._workers.pop(worker_id, None)

    # ---- liveness ----

    async def watch_heartbeats(self) -> None:
        """Declare workers lost when their reports stop."""
        while True:
            await asyncio.sleep(min(0.5, self._heartbeat_timeout_s / 4))
            now = time.monotonic()
            for wid, entry in list(self._workers.items()):
                if now - entry.last_seen > self._heartbeat_timeout_s and self._workers.get(wid) is entry:
                    log.warning("worker %s sent no report for %.1fs: routing around it", wid, now - entry.last_seen)
                    self._lost[wid] = entry.info.incarnation
                    self._declare_lost(wid, "it stopped responding")

    async def _watch_process(self, wid: str, incarnation: str, handle) -> None:
        """Route around a worker as soon as Ray reports its process dead (the heartbeat timeout is
        for workers that hang while alive)."""
        while True:
            try:
                await handle.watch.remote()
                return  # a clean shutdown
            except ray.exceptions.RayError:
                pass
            try:  # a call can fail while the process lives (a busy host): ask which process answers
                alive = await asyncio.wait_for(handle.incarnation.remote(), 2.0) == incarnation
            except (ray.exceptions.RayError, asyncio.TimeoutError):
                alive = False
            if not alive:
                break
        if not self.is_current(wid, incarnation):
            return  # already forgotten, or already replaced by its restarted self
        log.warning("worker %s died: routing around it", wid)
        self._declare_lost(wid, "its process died")

    def _declare_lost(self, wid: str, why: str) -> None:
        self.workers_lost += 1
        self._on_lost(wid, why)  # while the entry still exists: its requests name it
        self.remove(wid)
