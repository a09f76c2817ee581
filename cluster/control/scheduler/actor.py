"""The global scheduler actor: a thin Ray actor composed of owners that do not know each other.

- `WorkerRegistry`: registered workers, their reports, draining, liveness (registry.py)
- `RequestTable`: requests in flight, the KV each committed, reclaim (request_table.py)
- `Placer`: admission, routing, load shedding, decided with no await inside (placement.py); it owns the
  affinity keys' last placements (affinity.py)
- `PrefixIndex`: which worker caches which prefix blocks (prefix_index.py)
- `LinkCosts`: what a KV handoff costs on each prefill -> decode link, as measured (link_costs.py)
- `TenantShares`: no tenant holds more than its share of the KV or of the admission queue (tenant_shares.py)
- `Incarnation`: epoch, attempt ids, what a restart forgot (incarnation.py); `Outbox`: calls to workers and
  clients (outbox.py); `Rebuild`: what a restarted scheduler learns back from workers and clients, and
  what it answers meanwhile (rebuild.py, adoption.py)
- `DecisionClock`: how long decisions take and what the control plane costs (decision_clock.py)
- `UntilPlaced`: a request's wait for a placement, from the door to the carry-out (until_placed.py)
- `DemandWindow`: the demand and first-token waits the SLO autoscaler reads (autoscale/demand.py)

An async actor: every method runs on one event loop, so its state needs no locks, but an `await` lets
anything happen: after one, a placement is checked again (`still_valid`) before it is committed.

Request path (disaggregated): place the request (a decode worker with room, a prefill plan), reserve
the prompt's blocks on the decode worker, then send the attempt to the prefill worker with the
destination. When the decode worker has adopted the pages it says so in its next report (sent at once),
and the prefill worker is told to release its hold. Every terminal path runs one idempotent reclaim.

Clients' submits and aborts, and workers' reports, arrive over zmq (client_port.py): a tick's submits in
one frame, a process's reports in one frame (a real worker's one report, or every report of a simulated
host; the same messages either way). Calls to workers leave batched per tick (worker_mail.py): one Ray
call costs about what one placement does, so at thousands of requests per second the calls, not the
decisions, would be the scheduler's work.

What is left here are the entry points and the paths that await (the carry-out of a placement,
reservation, re-routing after a loss), which must re-check state after each await in one place; every
decision taken without an await lives in the owners above.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from actors.engine.kv.block_hash import PrefixHasher
from actors.protocol.ids import AttemptId
from actors.protocol.messages import (
    Admitted,
    AdmittedBy,
    Forgotten,
    GenerateRequest,
    KvDestination,
    LiveRequest,
    Rejected,
    SchedulerPort,
    WorkerInfo,
    WorkerPulse,
    WorkerReport,
    WorkerRequest,
)
from actors.protocol.request_status import RequestStatus
from actors.protocol.worker_commands import AbortAttempt, SubmitAttempt
from actors.tracing.tracer import start as start_tracing
from cluster.control.scheduler.admission_door import AdmissionDoor
from cluster.control.scheduler.pool_load import PoolLoad, pool_loads
from cluster.control.scheduler.demand import DemandSample, DemandWindow
from cluster.control.scheduler.client_port import ClientPort
from cluster.control.scheduler.decision_clock import ControlPlaneStats, DecisionClock
from cluster.control.scheduler.incarnation import Incarnation
from cluster.control.scheduler.link_costs import LinkCosts
from cluster.control.scheduler.outbox import Outbox
from cluster.control.scheduler.placement import Placement, Placer
from cluster.control.scheduler.placement_spans import PlacementSpans
from cluster.control.scheduler.prefix_index import PrefixIndex
from cluster.control.scheduler.rebuild import Rebuild
from cluster.control.scheduler.registry import WorkerRegistry
from cluster.control.scheduler.request_table import RequestTable
from cluster.control.scheduler.room_waiters import RoomWaiters
from cluster.control.scheduler.scheduler_state import Phase, SchedulerCounters, SchedulerSettings, SchedulerState, Tracked
from cluster.control.scheduler.tenant_shares import TenantShares
from cluster.control.scheduler.ttft_guard import shed_guard
from cluster.control.scheduler.until_placed import UntilPlaced
from cluster.control.scheduler.worker_mail import WorkerMail
from kv_transfer.curve import CurveKeys

log = logging.getLogger("tandem.scheduler")
_CALL_TIMEOUT_S = 30.0


class Scheduler:
    def __init__(self, settings: SchedulerSettings):
        self.s = settings
        self._registry = WorkerRegistry(settings.heartbeat_timeout_s, settings.progress_timeout_s, self._worker_gone)
        self._table = RequestTable()
        self._index = PrefixIndex()
        self._hasher = PrefixHasher(settings.block_size, settings.model_id)
        self._guard = shed_guard(settings)
        self._links = LinkCosts(settings.transfer_bytes_per_s)
        self._placer = Placer(settings, self._registry, self._table, self._index, self._guard, self._links)
        # The one observer of worker standing and committed KV: the placer keeps its orders from them.
        self._registry.on_change = self._table.on_change = self._placer.refresh
        self._shares = TenantShares(self._table, self._registry, settings.max_queued)
        self._door = AdmissionDoor(short_handed=lambda: self._registry.pool_size(self._placer.pool) == 0)
        self._demand = DemandWindow()
        self._out = Outbox(self._registry, WorkerMail(_CALL_TIMEOUT_S, settings.curve_keys), settings.curve_keys)
        self._clock = DecisionClock()
        self._spans = PlacementSpans(start_tracing(settings.tracing, "tandem-scheduler"))
        self._waiters = RoomWaiters()
        self._until_placed = UntilPlaced(settings, self._guard, self._registry, self._placer, self._shares,
                                         self._waiters, self._hasher, self._carry_out)
        self._incarnation = Incarnation(settings.heartbeat_timeout_s)
        self._rebuild = Rebuild(self._table, self._placer, self._out, self._incarnation,
                                lambda attempt: self._reclaim(attempt, failed=True))
        self._port: ClientPort | None = None  # opened on the first client's question (it needs the event loop)
        self._watchdog: asyncio.Task | None = None
        self._confirmations: asyncio.Task | None = None
        self._lost_submits = 0  # attempts sent to a live worker that never confirmed them
        self._submitted = self._rejected = self._local_prefills = self._rerouted = 0

    # ---- workers ----

    async def register(self, info: WorkerInfo, handle, live: list[LiveRequest] = ()) -> bool:
        """A worker joins: new, restarted by Ray (a new incarnation: its old requests are gone), or
        re-announcing itself (same incarnation) because this scheduler restarted or gave up on it.
        `live` is every request the worker still holds state for. False: a drained and removed worker's
        late call (it is stopping), refused."""
        if self._registry.is_retired(info):
            return False
        known = self._registry.get(info.worker_id)
        if known is not None and known.info.incarnation != info.incarnation:
            self._worker_gone(info.worker_id, "it restarted")
            self._registry.remove(info.worker_id)
        entry, new = self._registry.add(info, handle)
        if new:
            self._waiters.joined()
            log.info("registered %s worker %s (%d live requests)", info.role, info.worker_id, len(live))
        if self._registry.was_declared_lost(info):
            # Declared dead during a stall: its requests were re-routed or failed since; stop its copies.
            for item in live:
                self._out.abort_on(info.worker_id, item.request.attempt)
        else:
            self._rebuild.adopt(entry, live)
        if self._watchdog is None:
            loop = asyncio.get_running_loop()
            self._watchdog = loop.create_task(self._registry.watch_heartbeats())
            self._confirmations = loop.create_task(self._watch_unconfirmed())
        return True

    async def pulse(self, pulse: WorkerPulse) -> None:
        """A worker inside a long step: alive, though its report waits for the step's end."""
        self._registry.pulse(pulse)

    def _take_reports(self, batch: tuple[WorkerReport, ...]) -> tuple[str, ...]:
        """Workers' reports (client_port.py); answers with the workers it does not know: they register again."""
        return tuple(report.worker_id for report in batch if not self._take_report(report))

    def _take_report(self, report: WorkerReport) -> bool:
        # Let go of by the worker, registered or not yet (after a restart a report can beat its registration).
        for done in report.finished:
            if not self._reclaim(done.attempt, failed=done.status == RequestStatus.FAILED, skip=report.worker_id):
                self._table.ended(done.attempt)
        if not self._registry.observe(report.stats):
            return False
        self._index.apply(report.worker_id, report.kv_events)
        self._guard.observe(report.worker_id, report.first_token_waits)
        self._demand.first_tokens([w.seconds for w in report.first_token_waits])
        self._links.observe(report.worker_id, report.transfers)
        for attempt in report.received:
            self._table.confirm(attempt)
        for adopted in report.handed_off:
            self._handed_off(adopted.attempt, adopted.prefill_worker)
        return True

    def _handed_off(self, attempt: AttemptId, prefill_worker: str) -> None:
        """The decode worker adopted the pages: the prefill worker frees its copy (tracked or not: it holds them)."""
        self._table.handed_off(attempt)
        self._out.release_on(prefill_worker, attempt, role="prefill")

    async def drain(self, worker_id: str) -> None:
        """Route nothing new to the worker; what it serves now finishes there."""
        self._registry.drain(worker_id)

    async def remove(self, worker_id: str) -> bool:
        """Forget a drained worker; False (and nothing changes) while a request still involves it."""
        if self._table.touching(worker_id):
            return False
        self._registry.retire(worker_id)
        self._index.forget(worker_id)
        self._links.forget(worker_id)
        return True

    def _worker_gone(self, worker_id: str, why: str) -> None:
        """Every request that touches a lost worker: re-route it if nothing was emitted yet, else fail it
        as retryable (its client migrates it)."""
        self._out.mail.worker_gone(worker_id)
        self._index.forget(worker_id)
        self._links.forget(worker_id)
        for tracked in self._table.touching(worker_id):
            prefill_only = (tracked.prefill is not None and tracked.prefill.worker_id == worker_id
                            and tracked.phase is not Phase.HANDED_OFF)
            # Either way the attempt failed (a re-routed one is counted so as well, as a moved one is: its
            # request finishes once, with its next attempt).
            self._reclaim(tracked.attempt, failed=True, skip=worker_id)
            if prefill_only:
                # Nothing has reached the client from a prefill that never handed off: run it again. The client
                # is told the old attempt is stale: its worker may only be stalled, and finish it when it wakes.
                self._rerouted += 1
                self._out.tell_superseded(tracked)
                asyncio.get_running_loop().create_task(self._resubmit(tracked))
            else:
                self._out.tell_client(tracked, f"worker {worker_id} was lost ({why}) while serving the request")

    async def _watch_unconfirmed(self) -> None:
        """An attempt sent to a worker that has reported for a heartbeat timeout since without naming it
        never arrived (seen once in ~20 stressed runs: a submit to a worker Ray had just restarted, the
        worker alive and reporting, the request waiting forever). Its prompt was not computed, so nothing
        of this attempt reached the client: it is placed again."""
        while True:
            await asyncio.sleep(min(0.5, self.s.heartbeat_timeout_s / 4))
            self._out.mail.keep_only({e.info.command_endpoint for e in self._registry.entries().values()})
            self._rebuild.drop_orphans()
            now = time.monotonic()
            for tracked in self._table.unconfirmed(older_than=now - self.s.heartbeat_timeout_s):
                target = tracked.prefill.worker_id if tracked.prefill is not None else tracked.decode_id
                entry = self._registry.get(target)
                if entry is None or entry.last_report - tracked.since < self.s.heartbeat_timeout_s:
                    continue  # no report since (a pulse is no confirmation): the watchdog decides about it
                log.warning("attempt %s never reached worker %s: placing it again", tracked.attempt, target)
                self._lost_submits += 1
                self._reclaim(tracked.attempt, failed=True)
                self._rerouted += 1
                self._out.tell_superseded(tracked)  # in case it arrives after all
                asyncio.get_running_loop().create_task(self._resubmit(tracked))

    async def _resubmit(self, lost: Tracked) -> None:
        answer = await self._submit(lost.request, patient=True)
        if isinstance(answer, Rejected):
            self._out.tell_client(lost, f"could not re-route after a worker loss: {answer.reason}", retryable=False)

    # ---- requests ----

    async def client_port(self) -> SchedulerPort:
        """Where this incarnation takes its clients' submits and aborts and its workers' reports (client_port.py)."""
        if self._port is None:
            self._port = ClientPort(self.submit, self.abort, self._take_reports, self.s.curve_keys, self.s.host)
        return SchedulerPort(self._port.endpoint, self._incarnation.epoch)

    async def submit(self, request: GenerateRequest) -> Admitted | Rejected:
        """Admit and route one request (or the next attempt of a migrated one)."""
        if request.retried and not request.moved:
            again = await self._rebuild.admitted_before(request)
            if again is not None:
                return again
        return await self._submit(request, patient=request.moved)

    async def _submit(self, request: GenerateRequest, patient: bool) -> Admitted | Rejected:
        """`patient`: the request lost its worker (a migration, a re-routed prefill): it waits for a
        worker until its own deadline, since one that Ray restarts is back in seconds."""
        self._submitted += 1
        if not (request.retried or request.moved):
            self._demand.arrived(len(request.prompt_token_ids), request.params.max_tokens)
        self._table.admission_started(request.request_id)
        arrived = time.perf_counter()
        span, request = self._spans.begin(request)  # its workers continue the scheduler's span
        answer = None
        try:
            answer = await self._submit_once(request, patient)
        finally:
            self._table.admission_ended(request.request_id)
            self._spans.end(span, answer)
        if isinstance(answer, Admitted):
            self._clock.decided(time.perf_counter() - arrived)
        else:
            self._clock.refused(time.perf_counter() - arrived)
            self._rejected += 1  # counted here only, whichever owner refused it
        return answer

    async def _submit_once(self, request: GenerateRequest, patient: bool) -> Admitted | Rejected:
        tracked = self._table.get(request.request_id)
        if tracked is not None and request.moved:
            # Moved by its client (its worker lost, or no progress within the bound): the old attempt is
            # stopped wherever it still runs, so no work is done twice.
            self._reclaim(tracked.attempt, failed=True)
        elif tracked is not None:
            return Rejected(f"request_id {request.request_id!r} is already in flight", None)
        if self._door.waiting >= self.s.max_queued:
            return Rejected("the admission queue is full", self._placer.retry_after_s())
        if not patient:  # a moved request continues a stream the cluster already answered
            refused = self._door.refuse(self._until_placed.wait_budget_s(),
                                        lambda: self._placer.best_ttft_s(len(request.prompt_token_ids)))
            if refused is not None:
                return refused
        refused = self._shares.enter_queue(request)
        if refused is not None:
            return refused
        self._door.entered()
        answer = None
        try:
            answer = await self._until_placed.admit(request, patient)
            return answer
        finally:
            self._shares.leave_queue(request)
            self._door.left(isinstance(answer, Admitted))

    async def _carry_out(self, request: GenerateRequest, placement: Placement, blocks: int) -> Admitted | None:
        """Commit and send out a placement; None when it no longer holds (try placing again)."""
        attempt = self._incarnation.next_attempt(request.request_id)
        dest = None
        if not placement.local:
            decode = self._registry.get(placement.decode_id)
            # Queued on the prefill worker from now: placements decided during the await must see it.
            uncached = len(request.prompt_token_ids) - placement.prefill.cached_tokens
            with self._registry.queued_meanwhile(placement.prefill_id, uncached, request.cache_salt):
                reservation = await self._out.reserve(decode.info.command_endpoint, WorkerRequest(attempt, request),
                                                      placement.decode_id)
            # Anything may have happened during the await: a worker forgotten, replaced or draining, or
            # another request of the tenant admitted.
            if (reservation is None or not self._placer.still_valid(placement)
                    or not self._shares.fits(request, blocks, self._placer.pool)):
                if reservation is not None:  # to the process reserved on, even if since replaced
                    self._out.mail.send(decode.info.command_endpoint, AbortAttempt(placement.decode_id, attempt))
                return None
            dest = KvDestination(placement.decode_id, decode.info.kv_endpoints, reservation)
        if placement.local and self.s.mode != "colocated":
            self._local_prefills += 1
        prefill_id = placement.prefill_id
        workers = {placement.decode_id, prefill_id}
        superseded = self._table.commit(Tracked(request, attempt, workers, placement.decode_id, blocks,
                                                None if placement.local else placement.prefill))
        if superseded is not None:
            self._abort_on_workers(superseded)
        if placement.prefill is not None and placement.prefill.worker_id == prefill_id:
            self._guard.expect(attempt, placement.prefill, self._placer.step_s(prefill_id))
        target = self._registry.get(prefill_id)
        self._out.mail.send(target.info.command_endpoint, SubmitAttempt(prefill_id, WorkerRequest(attempt, request, dest)))
        cached = placement.prefill.cached_tokens if placement.prefill is not None else 0
        self._registry.add_queued(prefill_id, len(request.prompt_token_ids) - (0 if placement.local else cached),
                                  request.cache_salt)
        return Admitted(prefill_id, placement.decode_id, cached, placement.local, self._incarnation.epoch)

    async def abort(self, request_id: str) -> bool:
        tracked = self._table.get(request_id)
        if tracked is None:
            self._table.remember_abort(request_id)
            return False
        return self._reclaim(tracked.attempt, failed=False, cancelled=True)

    async def forgotten(self, admitted: tuple[AdmittedBy, ...]) -> Forgotten:
        """A client's audit of the requests an earlier incarnation admitted (rebuild.py)."""
        return self._rebuild.forgotten(admitted)

    def _reclaim(self, attempt: AttemptId, failed: bool, skip: str | None = None, cancelled: bool = False) -> bool:
        """Every terminal path ends here; a second call for the same attempt, or a report about an older
        attempt, does nothing."""
        tracked = self._table.reclaim(attempt, failed, cancelled)
        if tracked is None:
            return False
        self._waiters.freed()
        self._abort_on_workers(tracked, skip)
        return True

    def _abort_on_workers(self, tracked: Tracked, skip: str | None = None) -> None:
        self._guard.forget(tracked.attempt)
        self._out.abort(tracked, skip)

    # ---- introspection (for people, tests and metrics; not the control path) ----

    async def data_plane_keys(self) -> CurveKeys | None:
        """The cluster's CURVE keys, for a client joining it (through Ray, which authenticates it)."""
        return self.s.curve_keys

    async def state(self) -> SchedulerState:
        entries = self._registry.entries()
        counters = SchedulerCounters(
            self._submitted, self._rejected, self._table.finished, self._table.failed, self._table.cancelled,
            self._local_prefills, self._rerouted, self._placer.shed, self._registry.workers_lost,
            self._lost_submits)
        return SchedulerState(
            {wid: dataclasses.replace(e.view) for wid, e in entries.items()},
            {wid: e.stats for wid, e in entries.items() if e.stats is not None},
            {wid: e.info.incarnation for wid, e in entries.items()},
            self._registry.draining(), len(self._table), self._table.committed_blocks(), counters,
            self._table.tenant_blocks(), self._links.estimates(),
            self._port.drops.snapshot() if self._port is not None else {})

    async def pool_load(self) -> tuple[PoolLoad, ...]:
        """Each pool's load now, as the autoscaler reads it every interval (cluster/control/autoscale/)."""
        roles = ("colocated",) if self.s.mode == "colocated" else ("prefill", "decode")
        return pool_loads(self._registry, self._table, roles, self._placer.pool, self._door.waiting,
                          self._placer.typical_cost)

    async def demand_sample(self) -> DemandSample:
        """The demand since the last call and the pools' state now, as mode slo reads it every interval."""
        return self._demand.take(self._registry.entries().values(), self._placer.pool, self._door.waiting,
                                 len(self._table))

    async def control_stats(self, reset: bool = False) -> ControlPlaneStats:
        """Decision times and the control plane's own costs (`tandem bench control-plane`)."""
        return self._clock.stats(reset, len(self._table), self._index.size(), len(self._registry.ids()),
                                 self._out.mail)

    async def check_integrity(self) -> SchedulerState:
        self._index.check_integrity()
        self._registry.check_integrity()
        self._placer.check_integrity()
        self._shares.check_integrity()
        self._waiters.check_integrity()
        self._door.check_integrity()
        self._demand.check_integrity()
        if self._door.waiting != self._shares.queued():
            raise RuntimeError(f"{self._door.waiting} requests in admission, but the tenants' count is {self._shares.queued()}")
        self._links.check_integrity()
        self._table.check_integrity(self._registry.ids())
        return await self.state()

