"""The scheduler's worker registry: who is registered, their latest report, who is draining, who died.

One owner of the worker entries. Workers register themselves (again after a restart: a new
incarnation). A worker is declared lost as soon as Ray reports its process dead (`watch_process`), when
neither reports nor pulses come for the heartbeat timeout (the process hangs or is cut off), or when its
engine thread sends no report for the progress bound while its pulse says the process lives (a step or a
command that never ends; `watch_heartbeats`). A long step alone is never a death: the pulse (the worker's
pulse.py) keeps a busy worker alive. `on_lost(worker_id, why)` then lets the scheduler deal with its
requests. A worker declared lost while it was only stalled comes back
with the same incarnation: `was_declared_lost` tells the scheduler to stop its stale copies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import ray

from actors.protocol.messages import WorkerInfo, WorkerPulse, WorkerStats
from cluster.control.scheduler.routing import WorkerView
from cluster.control.scheduler.scheduler_state import WorkerEntry

log = logging.getLogger("tandem.scheduler")


class WorkerRegistry:
    def __init__(self, heartbeat_timeout_s: float, progress_timeout_s: float, on_lost: Callable[[str, str], None]):
        self._workers: dict[str, WorkerEntry] = {}
        self._pools: dict[str, dict[str, WorkerView]] = {}  # role -> views of its workers that take work
        self._sums: dict[str, tuple[int, int, float | None]] = {}  # role -> (blocks, largest, mean cost), cached
        self.on_change: Callable[[str], None] = lambda worker_id: None  # a worker's view or standing changed
        self._lost: dict[str, str] = {}  # worker id -> incarnation declared dead
        self._draining: set[str] = set()  # no new work; what they serve finishes
        self._retired: dict[str, str] = {}  # worker id -> incarnation removed after draining
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._progress_timeout_s = progress_timeout_s
        self._on_lost = on_lost
        self.workers_lost = 0

    def get(self, worker_id: str) -> WorkerEntry | None:
        return self._workers.get(worker_id)

    def ids(self) -> set[str]:
        return set(self._workers)

    def entries(self) -> dict[str, WorkerEntry]:
        return dict(self._workers)

    def views(self, role: str) -> list[WorkerView]:
        """The role's workers that take new work: registered, not draining, and not `stalled`."""
        now = time.monotonic()
        return [v for wid, v in self._pools.get(role, {}).items() if not self._stalled(wid, now)]

    def view(self, role: str, worker_id: str) -> WorkerView | None:
        """The worker's view if it is of `role` and takes new work."""
        view = self._pools.get(role, {}).get(worker_id)
        return None if view is None or self._stalled(worker_id, time.monotonic()) else view

    def _stalled(self, worker_id: str, now: float) -> bool:
        """Its engine has sent no report for half the progress bound. Clients move a request silent that
        long (cluster/frontend/request_stream.py), so the worker looks idle once its requests moved away;
        placed there again, a moved request would wait out the same step. It takes work again at its next
        report, or is declared lost at the full bound."""
        return now - self._workers[worker_id].last_report > self._progress_timeout_s / 2

    def pool_size(self, role: str) -> int:
        return len(self._pools.get(role, ()))

    def pool_blocks(self, role: str) -> int:
        """KV blocks of the role's workers that take work, in all."""
        return self._pool_sums(role)[0]

    def largest(self, role: str) -> int:
        """The most KV blocks one of the role's workers has (0: none takes work)."""
        return self._pool_sums(role)[1]

    def mean_prefill_cost(self, role: str) -> float | None:
        """The measured per-token prefill cost, averaged over the role's workers that have one."""
        return self._pool_sums(role)[2]

    def _pool_sums(self, role: str) -> tuple[int, int, float | None]:
        # Cached until a worker joins, leaves or reports other numbers: read per request, changed rarely.
        sums = self._sums.get(role)
        if sums is None:
            views = self.views(role)
            costs = [v.prefill_s_per_token for v in views if v.prefill_s_per_token is not None]
            sums = self._sums[role] = (sum(v.num_blocks for v in views), max((v.num_blocks for v in views), default=0),
                                       sum(costs) / len(costs) if costs else None)
        return sums

    @contextmanager
    def queued_meanwhile(self, worker_id: str, tokens: int, tenant: str | None) -> Iterator[None]:
        """Prompt tokens placed on the worker whose admission awaits the decode worker's reservation: queued
        there from the decision on, so placements decided during that await see them (and shed on them),
        whatever the worker reports meanwhile; the hold ends with the block, sent or not."""
        entry = self._workers.get(worker_id)
        if entry is not None:
            _hold(entry.held_by_tenant, tenant, tokens)
            self.add_queued(worker_id, tokens, tenant)
        try:
            yield
        finally:
            if entry is not None:
                _hold(entry.held_by_tenant, tenant, -tokens)
                if self._workers.get(worker_id) is entry:  # not replaced meanwhile
                    self.add_queued(worker_id, -tokens, tenant)

    def add_queued(self, worker_id: str, tokens: int, tenant: str | None) -> None:
        """Prompt tokens of the tenant just sent to the worker: queued there until its next report says
        otherwise."""
        entry = self._workers.get(worker_id)
        if entry is not None:
            entry.view.queued_prefill_tokens += tokens
            _add(entry.view.queued_by_tenant, tenant, tokens)
            self.on_change(worker_id)

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
        self._pools.setdefault(info.role, {})[info.worker_id] = view
        self._sums.pop(info.role, None)
        self.on_change(info.worker_id)
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
        entry.last_seen = entry.last_report = time.monotonic()
        entry.stats = stats
        v = entry.view
        if v.num_blocks != stats.num_blocks or v.prefill_s_per_token != stats.prefill_s_per_token:
            self._sums.pop(v.role, None)
        v.free_blocks, v.num_blocks = stats.free_blocks, stats.num_blocks
        v.running, v.waiting = stats.running, stats.waiting
        v.queued_by_tenant = dict(stats.queued_prefill_by_tenant)
        for tenant, tokens in entry.held_by_tenant.items():
            _add(v.queued_by_tenant, tenant, tokens)
        v.queued_prefill_tokens = stats.queued_prefill_tokens + sum(entry.held_by_tenant.values())
        v.prefill_s_per_token = stats.prefill_s_per_token
        self.on_change(stats.worker_id)
        return True

    def pulse(self, pulse: WorkerPulse) -> None:
        """The worker's process lives, its engine thread busy (a long step): not a death."""
        entry = self._workers.get(pulse.worker_id)
        if entry is not None and entry.info.incarnation == pulse.incarnation:
            entry.last_seen = time.monotonic()

    def drain(self, worker_id: str) -> None:
        entry = self._workers.get(worker_id)
        if entry is None:
            raise ValueError(f"unknown worker {worker_id!r}")
        self._draining.add(worker_id)
        self._leave_pool(entry)

    def is_draining(self, worker_id: str) -> bool:
        return worker_id in self._draining

    def draining(self) -> list[str]:
        return sorted(self._draining)

    def remove(self, worker_id: str) -> WorkerEntry | None:
        self._draining.discard(worker_id)
        entry = self._workers.pop(worker_id, None)
        if entry is not None:
            self._leave_pool(entry)
        return entry

    def retire(self, worker_id: str) -> WorkerEntry | None:
        """Forget a drained worker for good: this process may not register again. (A report it sent
        before it stopped is answered "unknown", and its register call would bring it back as a ghost
        that nothing routes around until the heartbeat timeout.)"""
        entry = self.remove(worker_id)
        if entry is not None:
            self._retired[worker_id] = entry.info.incarnation
        return entry

    def is_retired(self, info: WorkerInfo) -> bool:
        return self._retired.get(info.worker_id) == info.incarnation

    def _leave_pool(self, entry: WorkerEntry) -> None:
        role, wid = entry.view.role, entry.info.worker_id
        if self._pools.get(role, {}).pop(wid, None) is not None:
            self._sums.pop(role, None)
        self.on_change(wid)

    def check_integrity(self) -> None:
        pools = {(role, wid) for role, views in self._pools.items() for wid in views}
        taking = {(e.view.role, wid) for wid, e in self._workers.items() if wid not in self._draining}
        if pools != taking:
            raise RuntimeError(f"registry: pools {sorted(pools ^ taking)} differ from the workers that take work")
        held = {wid: e.held_by_tenant for wid, e in self._workers.items()
                if any(n < 0 for n in e.held_by_tenant.values())}
        if held:
            raise RuntimeError(f"registry: negative prompt tokens held for placements: {held}")

    # ---- liveness ----

    async def watch_heartbeats(self) -> None:
        """Declare workers lost when they fall silent, or when their engine thread never comes back."""
        while True:
            await asyncio.sleep(min(0.5, self._heartbeat_timeout_s / 4))
            now = time.monotonic()
            for wid, entry in list(self._workers.items()):
                silent_s, busy_s = now - entry.last_seen, now - entry.last_report
                if silent_s > self._heartbeat_timeout_s:
                    why = f"sent no report or pulse for {silent_s:.1f}s"
                elif busy_s > self._progress_timeout_s:
                    why = f"its engine has sent no report for {busy_s:.1f}s (a step or command that does not end)"
                else:
                    continue
                if self._workers.get(wid) is entry:
                    log.warning("worker %s %s: routing around it", wid, why)
                    self._lost[wid] = entry.info.incarnation
                    self._declare_lost(wid, "it stopped responding")

    async def _watch_process(self, wid: str, incarnation: str, handle) -> None:
        """Route around a worker as soon as Ray reports its process dead (the heartbeat timeout is
        for workers that hang while alive)."""
        while True:
            try:
                await handle.watch.remote(wid)
                return  # a clean shutdown
            except ray.exceptions.RayError:
                pass
            try:  # a call can fail while the process lives (a busy host): ask which process answers
                alive = await asyncio.wait_for(handle.incarnation.remote(wid), 2.0) == incarnation
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


def _add(counts: dict[str | None, int], tenant: str | None, tokens: int) -> None:
    """Tokens added to (or, negative, taken from) a tenant's count; a count that reaches 0 goes."""
    left = counts.get(tenant, 0) + tokens
    if left > 0:
        counts[tenant] = left
    else:
        counts.pop(tenant, None)


def _hold(held: dict[str | None, int], tenant: str | None, tokens: int) -> None:
    """Like `_add`, but a negative count stays, for check_integrity to find."""
    held[tenant] = held.get(tenant, 0) + tokens
    if held[tenant] == 0:
        del held[tenant]
